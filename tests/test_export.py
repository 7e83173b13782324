"""``brace-lightning export``: Hugging Face folders from single-process and sharded checkpoints and at
the end of ``fit``, loading with ``from_pretrained`` to the trainer's log-probs and values, served by
vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from brace_lightning.cli import run
from brace_lightning.export import export_checkpoint, load_exported_critic
from brace_lightning.models.policy import token_logprobs
from tests.test_trainer import small_run

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["3+4=", "9+9=7", "1+1=2 and"]


def _batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask of TEXTS."""
    rows = [tokenizer(t)["input_ids"] for t in TEXTS]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.bool)
    return ids, mask


def _assert_same_outputs(module, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(out / "actor")
    actor = AutoModelForCausalLM.from_pretrained(out / "actor", dtype=torch.float32).eval()
    critic = load_exported_critic(out / "critic", dtype=torch.float32).eval()
    ids, mask = _batch(tokenizer)
    assert tokenizer.decode(tokenizer("1+1=2")["input_ids"]) == "1+1=2"
    with torch.no_grad():
        module.actor.eval()
        module.critic.eval()
        want, _ = token_logprobs(module.actor, ids, mask)
        got, _ = token_logprobs(actor, ids, mask)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(critic(ids, mask), module.critic(ids, mask), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """A short quickstart run (checkpoint on) that also exports at fit end; (cli, root)."""
    root = tmp_path_factory.mktemp("run")
    cli = run(
        small_run(
            root,
            "--trainer.enable_checkpointing=true",
            "--trainer.callbacks+=brace_lightning.export.ExportOnFitEnd",
            f"--trainer.callbacks.out={root / 'at_fit_end'}",
        )
    )
    return cli, root


def test_export_of_a_checkpoint_file_matches_the_trainer(trained, tmp_path: Path) -> None:
    cli, _ = trained
    ckpt = Path(cli.trainer.checkpoint_callback.best_model_path)
    assert ckpt.is_file()
    out = export_checkpoint(ckpt, tmp_path / "exported")
    _assert_same_outputs(cli.model, out)


def test_the_fit_end_callback_exports_the_final_weights(trained) -> None:
    cli, root = trained
    _assert_same_outputs(cli.model, root / "at_fit_end")


def export_command(ckpt_path: Path, out: Path) -> subprocess.CompletedProcess:
    """Run ``brace-lightning export`` as a user would."""
    return subprocess.run(
        [
            str(Path(sys.executable).with_name("brace-lightning")),
            "export",
            f"--ckpt_path={ckpt_path}",
            f"--out={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_export_command_refuses_a_missing_checkpoint_with_one_sentence(tmp_path: Path) -> None:
    done = export_command(tmp_path / "nope.ckpt", tmp_path / "out")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: ckpt_path={str(tmp_path / 'nope.ckpt')!r} does not exist; expected a .ckpt file "
        "or a sharded checkpoint folder."
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_of_a_sharded_fsdp_checkpoint_matches_the_gathered_weights(tmp_path: Path) -> None:
    from tests.test_parallel import _cli, _driver, _weights

    first = tmp_path / "first"
    ckpt = tmp_path / "ckpt"
    _driver(
        first,
        *_cli(tmp_path, "fsdp/cpu_2proc.yaml"),
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpt}",
        # FSDP: gathered on rank 0 only, bucket by bucket (models/weight_sync.py)
        "--trainer.callbacks+=brace_lightning.export.ExportOnFitEnd",
        f"--trainer.callbacks.out={tmp_path / 'at_fit_end'}",
        "--trainer.max_steps=1",
    )
    (checkpoint,) = ckpt.iterdir()
    assert checkpoint.is_dir()
    done = export_command(checkpoint, tmp_path / "exported")
    assert done.returncode == 0, done.stderr[-3000:]
    gathered = _weights(first)  # the full weights rank 0 gathered at the end of that run
    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "exported" / "actor")
    critic = load_exported_critic(tmp_path / "exported" / "critic")
    at_fit_end = AutoModelForCausalLM.from_pretrained(tmp_path / "at_fit_end" / "actor")
    critic_at_fit_end = load_exported_critic(tmp_path / "at_fit_end" / "critic")
    for name, state in (
        ("actor", actor.state_dict()),
        ("critic", critic.state_dict()),
        ("actor", at_fit_end.state_dict()),
        ("critic", critic_at_fit_end.state_dict()),
    ):
        for key, tensor in gathered[name].items():
            torch.testing.assert_close(state[key], tensor, rtol=0, atol=0, msg=f"{name}.{key}")


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_the_exported_actor_with_the_trainer_log_probs(trained, tmp_path: Path) -> None:
    from tests.support.vllm_support import require_vllm

    require_vllm()
    import vllm

    cli, root = trained
    out = root / "at_fit_end" / "actor"
    llm = vllm.LLM(model=str(out), dtype="float32", enforce_eager=True, max_model_len=64, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    params = vllm.SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=0)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=tokenizer(t)["input_ids"]) for t in TEXTS]
    try:
        results = llm.generate(prompts, params, use_tqdm=False)
    finally:  # now, not whenever the LLM is garbage-collected (vLLM then tears down process state)
        llm.llm_engine.engine_core.shutdown()
    actor = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    gap = 0.0
    for result in results:
        sample = result.outputs[0]
        ids = torch.tensor([list(result.prompt_token_ids) + list(sample.token_ids)])
        with torch.no_grad():
            want, _ = token_logprobs(actor, ids, torch.ones_like(ids, dtype=torch.bool))
        start = len(result.prompt_token_ids)
        for i, (token, logprobs) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
            gap = max(gap, abs(logprobs[token].logprob - float(want[0, start + i])))
    assert gap < 1e-3
