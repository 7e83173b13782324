"""Packed sequences (``models/packing.py``) against the padded path, Qwen2- and Llama-shaped: the
actor's log-probs, the critic's values, the check that refuses models which cannot pack, and whole
training steps with ``pack_sequences`` (and the fallback to padded rows), and a smoke run of the
throughput benchmark (``benchmarks/long_responses.py``)."""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import BloomConfig, FalconConfig, LlamaConfig, MistralConfig, PretrainedConfig
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

import brace_lightning.scorer
from brace_lightning.models.critic import ValueModel
from brace_lightning.models.packing import (
    VARLEN_SDPA,
    pack_rows,
    packed_forward,
    packed_token_logprobs,
    packed_values,
    packing_problem,
    prepare_packing,
    row_lengths,
    use_varlen_attention,
    varlen_sdpa_attention,
)
from brace_lightning.models.policy import load_causal_lm, tiny_qwen2_config, token_logprobs
from brace_lightning.models.sources import TINY
from brace_lightning.models.tokenizer import build_char_tokenizer
from brace_lightning.objectives import PPOEWMA
from tests.test_kl_reference import fit_steps, fixed_batch, perturbed_reference, sgd_module, weights


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows of lengths 9, 3, 1 and 12."""
    gen = torch.Generator().manual_seed(0)
    lengths = [9, 3, 1, 12]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(2, vocab, (n,), generator=gen)
        mask[i, -n:] = True
    return ids, mask


def _models(varlen: bool = False) -> list[torch.nn.Module]:
    """A Qwen2- and a Llama-shaped tiny actor, on SDPA (``varlen``: on ``VARLEN_SDPA``)."""
    qwen = tiny_qwen2_config(
        97, hidden_size=64, num_heads=2, num_kv_heads=1, tie_word_embeddings=False
    )
    llama = LlamaConfig(
        vocab_size=89,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    models = [load_causal_lm(qwen, seed=0), load_causal_lm(llama, seed=1)]
    for model in models:
        assert model.config._attn_implementation == "sdpa"
        assert use_varlen_attention(model) if varlen else True
    return models


def test_pack_rows_restarts_positions():
    ids, mask = _batch(50)
    packed, positions = pack_rows(ids, mask)
    assert packed.shape == positions.shape == (1, 25)
    assert positions[0].tolist() == [*range(9), *range(3), 0, *range(12)]
    assert packed[0, :9].tolist() == ids[0, -9:].tolist()


@pytest.mark.parametrize("varlen", [False, True], ids=["sdpa-mask", "varlen"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_and_gradients_equal_padded(temperature, varlen):
    for model in _models(varlen):
        ids, mask = _batch(model.config.vocab_size)
        weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
        results = []
        for fn in (token_logprobs, packed_token_logprobs):
            model.zero_grad(set_to_none=True)
            lp, ent = fn(model, ids, mask, temperature=temperature, return_entropy=True)
            ((lp * weights).sum() + ent.sum()).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            results.append((lp.detach(), ent.detach(), grads))
        (lp0, ent0, g0), (lp1, ent1, g1) = results
        torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
        assert (lp1[~mask] == 0).all() and (lp1[2] == 0).all()
        for name, grad in g0.items():
            torch.testing.assert_close(g1[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("varlen", [False, True], ids=["sdpa-mask", "varlen"])
def test_packed_values_and_gradients_equal_padded(varlen):
    for actor in _models(varlen):
        critic = ValueModel.from_actor(actor, seed=3, head_init_std=0.1)
        ids, mask = _batch(actor.config.vocab_size)
        weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
        results = []
        for values_of in (critic, functools.partial(packed_values, critic)):
            critic.zero_grad(set_to_none=True)
            values = values_of(ids, mask)
            (values * weights).sum().backward()
            grads = {n: p.grad.clone() for n, p in critic.named_parameters()}
            results.append((values.detach(), grads))
        (v0, g0), (v1, g1) = results
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-6)
        assert (v1[~mask] == 0).all()
        for name, grad in g0.items():
            torch.testing.assert_close(g1[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_row_lengths_reads_the_restarts_like_transformers():
    assert row_lengths(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])) == [3, 2, 1, 4]
    assert row_lengths(torch.tensor([[5, 6, 7, 0]])) == [3, 1]  # a row need not start at 0
    assert row_lengths(torch.arange(6)[None]) is None  # one row
    assert row_lengths(torch.tensor([[0, 1, 0], [0, 1, 0]])) is None  # a batch: not packed
    assert row_lengths(torch.tensor([[0]])) is None


def test_varlen_attention_runs_each_packed_row_alone_without_a_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a packed row the VARLEN_SDPA model calls SDPA once per original row, causal and with no
    mask (no ``N × N`` mask is built); padded rows and generation still get SDPA's mask."""
    model = _models(varlen=True)[0]
    ids, mask = _batch(model.config.vocab_size)
    calls: list[tuple[int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query: torch.Tensor, *args: Any, attn_mask: Any = None, **kwargs: Any) -> Any:
        calls.append((query.shape[2], attn_mask is None))
        return sdpa(query, *args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    packed_token_logprobs(model, ids, mask)
    layers = model.config.num_hidden_layers
    assert calls == [(n, True) for n in (9, 3, 1, 12)] * layers
    calls.clear()
    token_logprobs(model, ids, mask)  # left padding: the mask SDPA always had
    assert calls == [(12, False)] * layers
    calls.clear()
    with packed_forward():  # a packed call whose positions do not restart is one causal row
        varlen_sdpa_attention(
            model.model.layers[0].self_attn,
            *(torch.randn(1, 2, 5, 32) for _ in range(3)),
            None,
            position_ids=torch.arange(5)[None],
        )
    assert calls == [(5, True)]


def test_use_varlen_attention_switches_sdpa_only():
    actor, llama = _models()
    critic = ValueModel.from_actor(actor)
    assert use_varlen_attention(actor) and actor.config._attn_implementation == VARLEN_SDPA
    assert use_varlen_attention(critic) and critic.backbone.config._attn_implementation == (
        VARLEN_SDPA
    )
    assert use_varlen_attention(actor)  # idempotent
    llama.config._attn_implementation = "eager"
    assert not use_varlen_attention(llama) and llama.config._attn_implementation == "eager"
    assert "_attn_implementation" not in actor.config.to_json_string()  # never saved with it
    # A sliding window stays with SDPA's mask, which keeps it (row-by-row attention would not).
    mistral = load_causal_lm(
        MistralConfig(
            vocab_size=89,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=3,
        ),
        seed=0,
    )
    assert not use_varlen_attention(mistral) and mistral.config._attn_implementation == "sdpa"
    assert prepare_packing(mistral) is None  # it still packs, with the dense windowed mask


def test_prepare_packing_keeps_varlen_only_where_it_is_right():
    for model in _models():
        assert prepare_packing(model) is None
        assert model.config._attn_implementation == VARLEN_SDPA
    # Falcon's own code branches on the name "sdpa": with VARLEN_SDPA its packed forward fails,
    # so it goes back to SDPA, whose mask it ignores (it cannot pack at all).
    falcon = load_causal_lm(
        FalconConfig(vocab_size=89, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
        seed=0,
    )
    assert use_varlen_attention(falcon)
    assert packing_problem(falcon).startswith("a packed forward failed (TypeError: ")
    falcon.config._attn_implementation = "sdpa"
    assert "packed rows do not match the rows run one by one" in prepare_packing(falcon)
    assert falcon.config._attn_implementation == "sdpa"


def test_packing_problem_passes_qwen2_and_llama_actors_and_critics():
    for actor in [*_models(), *_models(varlen=True)]:
        for model in (actor.train(), ValueModel.from_actor(actor)):
            assert packing_problem(model) is None, type(model).__name__
            assert model.training  # the probe runs in eval mode, then restores the mode


def test_packing_problem_names_models_that_cannot_pack():
    # Falcon takes position ids but does not pass them to its mask: its packed rows attend to each
    # other, which only running the model shows. BLOOM (ALiBi) takes no position ids at all.
    falcon = load_causal_lm(
        FalconConfig(vocab_size=89, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
        seed=0,
    )
    for model in (falcon, ValueModel.from_actor(falcon)):
        assert "packed rows do not match the rows run one by one" in packing_problem(model)
    bloom = load_causal_lm(
        BloomConfig(vocab_size=89, hidden_size=32, n_layer=2, n_head=4),
        seed=0,
        attn_implementation="eager",
    )
    assert packing_problem(bloom) == "BloomModel.forward takes no position_ids"
    qwen = _models()[0]
    qwen.config._attn_implementation = "paged|eager"
    assert packing_problem(qwen) == (
        "transformers builds no packed-sequence mask for attention 'paged|eager'"
    )


def _actor_folder(tmp_path: Path, config: PretrainedConfig) -> str:
    """A randomly initialised actor of ``config`` saved with the character tokenizer."""
    tokenizer = build_char_tokenizer()
    folder = tmp_path / type(config).__name__
    load_causal_lm(config, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _llama(vocab: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )


def _train(source: str, **kwargs: Any) -> tuple[dict[str, dict], dict[str, float]]:
    """Actor and critic weights after one SGD rollout step on the fixed batch (2 minibatches),
    and its metrics. With an EWMA actor it scores already (as from the second step on); with
    ``kl_coef`` the reference differs from the actor (as after training)."""
    module = sgd_module(actor=source, num_minibatches=2, **kwargs)
    if module.ewma_actor is not None:
        module.ewma.steps.fill_(1)
    if module.reference_actor is not None:
        perturbed_reference(module)
    metrics = fit_steps(module, fixed_batch(), steps=1)
    assert module.scorer.packed is kwargs.get("pack_sequences", True)
    if module.scorer.packed:  # every SDPA model of the run attends row by row on packed rows
        copies = [m for m in (module.ewma_actor, module.reference_actor) if m is not None]
        for model in (module.actor, module.critic.backbone, *copies):
            assert model.config._attn_implementation == VARLEN_SDPA
    return {"actor": weights(module.actor), "critic": weights(module.critic)}, metrics


@pytest.mark.parametrize("shape", ["qwen2", "llama"])
def test_a_packed_training_step_equals_the_padded_one(
    shape: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed micro-batches under a 12-real-token budget end at the weights of one padded batch,
    and no actor or critic forward sees padded rows. The Qwen2 step also scores with an EWMA
    actor and a KL reference policy (both packed)."""
    vocab = len(build_char_tokenizer())
    source = TINY if shape == "qwen2" else _actor_folder(tmp_path, _llama(vocab))
    extra: dict[str, Any] = {}
    if shape == "qwen2":
        extra = {"actor_objective": PPOEWMA(ewma_decay=0.5), "kl_coef": 0.05}
    padded, padded_metrics = _train(source, pack_sequences=False, **extra)
    assert padded_metrics["actor/grad_norm"] > 0 and padded_metrics["critic/grad_norm"] > 0

    def padded_call(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a packed run called token_logprobs on padded rows")

    monkeypatch.setattr(brace_lightning.scorer, "token_logprobs", padded_call)
    critic_calls: list[bool] = []
    monkeypatch.setattr(
        ValueModel,
        "forward",
        functools.partialmethod(_recording_forward, critic_calls, ValueModel.forward),
    )
    packed, packed_metrics = _train(
        source, pack_sequences=True, max_tokens_per_micro_batch=12, **extra
    )
    assert critic_calls and not any(critic_calls), "a critic forward ran on padded rows"
    for name in ("actor", "critic"):
        for key, value in packed[name].items():
            torch.testing.assert_close(value, padded[name][key], rtol=1e-5, atol=1e-5, msg=key)
    keys = ["actor/loss", "critic/loss", "actor/grad_norm", "critic/grad_norm"]
    if shape == "qwen2":
        keys += ["actor/kl_ref_loss", "kl/ref"]
    for key in keys:
        assert packed_metrics[key] == pytest.approx(padded_metrics[key], rel=1e-5, abs=1e-6), key


def test_activation_checkpointing_recomputes_packed_rows_to_the_same_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without FSDP2, ``activation_checkpointing`` reruns every decoder block in the backward
    pass (row-by-row attention again, from the saved position ids) and ends at the weights of the
    padded step without it."""
    padded, _ = _train(TINY, pack_sequences=False)
    calls: list[int] = []
    forward = Qwen2DecoderLayer.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(Qwen2DecoderLayer, "forward", counting)
    runs = {}
    for checkpointed in (False, True):
        calls.clear()
        runs[checkpointed], _ = _train(TINY, activation_checkpointing=checkpointed)
        runs[checkpointed]["calls"] = len(calls)
    assert runs[True]["calls"] > runs[False]["calls"]  # the recompute
    for name in ("actor", "critic"):
        for key, value in runs[True][name].items():
            torch.testing.assert_close(value, padded[name][key], rtol=1e-5, atol=1e-5, msg=key)


def _recording_forward(
    critic: ValueModel,
    calls: list[bool],
    forward: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ValueModel.forward`` that records whether it got padded rows (an attention mask)."""
    calls.append(attention_mask is not None)
    return forward(critic, input_ids, attention_mask, position_ids)


def test_a_model_that_cannot_pack_trains_on_padded_rows_after_one_sentence(
    tmp_path: Path,
) -> None:
    vocab = len(build_char_tokenizer())
    falcon = _actor_folder(
        tmp_path,
        FalconConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
    )
    padded, _ = _train(falcon, pack_sequences=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = sgd_module(actor=falcon, num_minibatches=2, pack_sequences=True)
        fit_steps(module, fixed_batch(), steps=1)
    sentences = [str(w.message) for w in caught if "pack_sequences" in str(w.message)]
    assert sentences == [
        "pack_sequences=True: the FalconForCausalLM cannot run on packed rows (its packed rows do "
        f"not match the rows run one by one{sentences[0].split('one by one')[1]}"
    ]
    assert sentences[0].endswith("); every forward uses padded rows.")
    assert module.scorer.packed is False
    assert module.actor.config._attn_implementation == "sdpa"
    for name, model in (("actor", module.actor), ("critic", module.critic)):
        for key, value in weights(model).items():
            assert torch.equal(value, padded[name][key]), key


def _benchmark(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.<name> args`` from the repository root; fails on a non-zero exit
    unless ``check`` is False."""
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
        check=check,
    )


@pytest.mark.slow
def test_the_long_responses_benchmark_prints_both_tables_with_the_packed_case() -> None:
    quick = "--layers 1 --vocab 1000 --lengths 16 --rows 4 --batch-lengths 8 64 --max-tokens 96"
    done = _benchmark("long_responses", *quick.split(), "--repeats", "1")
    lines = done.stdout.splitlines()
    assert any(line.startswith("| 16 | chunked |") for line in lines), done.stdout
    assert "4 responses, log-uniform 8..64 (seed 0): 170 tokens, longest 60" in done.stdout
    # Rows of 60, 35, 21 and 54 tokens: padded under 96 tokens, 60 + 54 + 2 × 35 are computed in
    # 3 forwards; packed, only the 170 real ones, in 3 forwards (60 | 54 + 35 | 21).
    table = {line.split(" | ")[0]: line.split(" | ")[1:3] for line in lines if "budget" in line}
    assert table["| sorted, 96 padded-token budget, chunked"] == ["3", "184"]
    assert table["| sorted, 96 real-token budget, packed, chunked"] == ["3", "170"]


@pytest.mark.slow
def test_the_long_responses_benchmark_runs_only_the_chosen_plans_beside_the_baseline() -> None:
    quick = "--layers 1 --vocab 1000 --lengths --rows 4 --batch-lengths 8 64 --max-tokens 96"
    done = _benchmark("long_responses", *quick.split(), "--repeats", "1", "--plans", "packed")
    plans = [line.split(" | ")[0][2:] for line in done.stdout.splitlines() if " rows " in line]
    plans += [line.split(" | ")[0][2:] for line in done.stdout.splitlines() if "sorted" in line]
    assert plans == [
        "2 rows in arrival order, padded, full logits",
        "sorted, 96 real-token budget, packed, chunked",
    ], done.stdout


@pytest.mark.slow
def test_the_long_responses_benchmark_climbs_the_length_ladder_until_a_rung_fails() -> None:
    quick = "--layers 1 --vocab 1000 --lengths --rows 0 --largest --ladder-start 32 --max-length 64"
    ample = _benchmark("long_responses", *quick.split(), "--memory-gib", "8").stdout
    for path in ("full", "chunked"):  # rungs 32 and 64 both ran
        assert any(
            line.startswith(f"| {path} | 64 | ") and line.endswith(" | - |")
            for line in ample.splitlines()
        ), ample
    # 0.3 GiB of address space cannot even map libtorch: the first rung fails, and says why
    starved = _benchmark("long_responses", *quick.split(), "--memory-gib", "0.3").stdout
    assert "| full | - | - | - | - | 32 (" in starved, starved
    assert "| chunked | - | - | - | - | 32 (" in starved, starved
    # parts 1 and 2 measure memory in a child under the same cap: a case that does not fit ends
    # the benchmark with one sentence before any timed run
    tiny = "--layers 1 --vocab 1000 --lengths 16 --rows 0 --repeats 1 --memory-gib 0.3"
    capped = _benchmark("long_responses", *tiny.split(), check=False)
    assert capped.returncode != 0 and "| T | path |" not in capped.stdout
    assert "the memory-measuring child failed within 0.3 GiB of address space (" in capped.stderr
    # --paths climbs one path's ladder alone (e.g. one more rung of the chunked one)
    one = _benchmark("long_responses", *quick.split(), "--memory-gib", "8", "--paths", "chunked")
    rows = [line for line in one.stdout.splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[0] for line in rows] == ["| chunked"], one.stdout


@pytest.mark.slow
def test_the_train_step_benchmark_times_padded_and_both_packed_attentions() -> None:
    done = _benchmark("train_step", "--packing", "--steps", "2", "--repeats", "1")
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]  # no header
    assert [row.split(" | ")[0] for row in rows] == [
        "| padded",
        "| packed, row-by-row SDPA",
        "| packed, dense N × N mask",
    ], done.stdout
    assert rows[0].endswith("| 1.00 |")
    for row in rows:
        step, update, forward, ratio = (float(x) for x in row.strip("| ").split(" | ")[1:])
        assert step > 0 and update > 0 and forward > 0 and ratio > 0


@pytest.mark.slow
def test_the_train_step_benchmark_compares_the_targets_it_is_given_against_the_first() -> None:
    done = _benchmark(
        "train_step", "--targets", "grpo", "grpo_opob", "--steps", "2", "--repeats", "1"
    )
    assert "| overhead vs grpo |" in done.stdout, done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]  # no header
    assert [row.split(" | ")[0] for row in rows] == ["| grpo", "| grpo_opob"], done.stdout
    assert rows[0].endswith("| +0.000% |")
    base, optimal = (float(row.split(" | ")[2]) for row in rows)  # value target ms
    assert optimal > base > 0  # the optimal baseline's per-row backward passes are timed
    bad = _benchmark("train_step", "--targets", "no_such_target", check=False)
    assert bad.returncode == 2 and "--targets: 'no_such_target' is not a file" in bad.stderr


@pytest.mark.parametrize(("padded_logprobs", "chunk"), [("full", None), ("chunked", 8)])
def test_the_long_responses_padded_baseline_takes_the_log_probs_path_it_is_given(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    padded_logprobs: str,
    chunk: int | None,
) -> None:
    from benchmarks import long_responses

    args = argparse.Namespace(
        lengths=[], rows=3, batch_lengths=[4, 16], seed=0, device="cpu", paths=["full"],
        padded_rows=2, max_tokens=32, plans=[], chunk_size=8, padded_logprobs=padded_logprobs,
    )  # fmt: skip
    config = long_responses.qwen2_config(layers=1, vocab_size=64, max_positions=17)
    model = long_responses.load_causal_lm(config, seed=0)
    sizes: list[int | None] = []

    def recording(*a: Any, chunk_size: int | None = None, **kw: Any) -> Any:
        sizes.append(chunk_size)
        return token_logprobs(*a, chunk_size=chunk_size, **kw)

    monkeypatch.setattr(long_responses, "token_logprobs", recording)
    measured = long_responses.cases(args, model, None)
    assert list(measured) == ["batch/padded"]
    measured["batch/padded"][0]()
    assert sizes == [chunk, chunk]  # two micro-batches of at most 2 rows, both on the given path
    args.critic = False
    long_responses.print_batch_table(args, {"batch/padded": 1.0}, {"batch/padded": None})
    label = "full logits" if padded_logprobs == "full" else "chunked"
    assert f"| 2 rows in arrival order, padded, {label} | 2 |" in capsys.readouterr().out
