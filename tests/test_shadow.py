"""Shadow critics (issue 31): the recorder (``brace_lightning/shadow.py``) and the offline critic
trainer and its aggregation (``benchmarks/lm_shadow_critics.py``)."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import lm_shadow_critics as shadow_critics
from benchmarks import lm_staleness_map as lm_map
from brace_lightning.cli import run
from brace_lightning.models import load_tokenizer
from brace_lightning.models.policy import token_logprobs
from brace_lightning.models.sources import load_actor
from brace_lightning.module import BraceModule
from brace_lightning.objectives import CriticLoss
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.scorer import Scorer
from brace_lightning.shadow import (
    ShadowRecorder,
    load_meta,
    load_version,
    stream_sha256,
    version_files,
)
from tests.benchmarks.test_lm_staleness import fake_warm_start, tiny_recipe

ROOT = Path(__file__).resolve().parents[1]
STEPS, ROWS = 3, 3
HIDDEN, LAYERS = 64, 1


def _fit_args(out: Path, recorder: Path | None) -> list[str]:
    """A 3-step quickstart fit with GAE(1) at lag 1 (the actor steps from step 1) and 2 critic
    steps on the whole batch per version, its metrics and weight hashes recorded by the
    recorded-runs ``Recorder``; with ``recorder`` the ShadowRecorder too."""
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--config",
        str(ROOT / "configs" / "targets" / "gae.yaml"),
        "--model.ppo_epochs=2",
        "--model.num_minibatches=1",
        "--trainer.callbacks=[]",
        f"--trainer.limit_train_batches={STEPS}",
        f"--trainer.default_root_dir={out}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        f"--model.tiny_hidden_size={HIDDEN}",
        f"--model.tiny_num_layers={LAYERS}",
        "--model.critic_warmup_steps=1",
        "--model.skip_equal_reward_batches=false",
        "--data.prompts_per_step=4",
        "--data.samples_per_prompt=2",
        "--data.engine.init_args.max_new_tokens=12",
        "--data.lag=1",
        "--data.max_staleness=1",
        "--trainer.callbacks+=tests.support.recorded_runs.Recorder",
        f"--trainer.callbacks.out={out / 'record'}",
    ]
    if recorder is not None:
        args += [
            "--trainer.callbacks+=brace_lightning.shadow.ShadowRecorder",
            f"--trainer.callbacks.folder={recorder}",
            f"--trainer.callbacks.on_policy_rows={ROWS}",
        ]
    return args


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """The same tiny fit without and with the recorder; with it, what the module scored at each
    step (π_prox log-probs, the batch's tokens) and the actor's weights then (π_v)."""
    tmp = tmp_path_factory.mktemp("shadow")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("PL_GLOBAL_SEED", raising=False)
        run(_fit_args(tmp / "plain", None))
        patch.delenv("PL_GLOBAL_SEED", raising=False)
        spied: list[dict] = []
        score = BraceModule._score

        def spy(self, batch, plan):
            actor = {k: v.detach().clone() for k, v in self.actor.state_dict().items()}
            out = score(self, batch, plan)
            spied.append(
                {"proximal": out[1].proximal.clone(), "input_ids": batch.input_ids.clone(),
                 "actor": actor, "version": self.policy_version}
            )  # fmt: skip
            return out

        patch.setattr(BraceModule, "_score", spy)
        stream = tmp / "recorded" / "stream"
        cli = run(_fit_args(tmp / "recorded", stream))
    critic = {k: v.detach().clone() for k, v in cli.model.critic.state_dict().items()}
    return types.SimpleNamespace(tmp=tmp, stream=stream, spied=spied, critic=critic)


def test_a_run_with_the_recorder_logs_the_same_metrics_and_ends_with_the_same_weights(recorded):
    plain = json.loads((recorded.tmp / "plain" / "record" / "record.json").read_text())
    with_recorder = json.loads((recorded.tmp / "recorded" / "record" / "record.json").read_text())
    assert len(plain["steps"]) == STEPS
    assert plain["steps"] == with_recorder["steps"]  # every deterministic metric, every step
    assert plain["weights_sha256"] == with_recorder["weights_sha256"]  # actor and critic


def test_recorded_files_hold_the_trained_batch_with_the_modules_pi_prox(recorded):
    files = version_files(recorded.stream)
    assert [f.name for f in files] == [f"v{v:05d}.pt" for v in range(STEPS)]
    meta = load_meta(recorded.stream)
    assert meta["lag"] == 1 and meta["critic_optimizer"]["lr"] == 0.001
    assert meta["engine"] == {"class": "EmbeddedEngine", "temperature": 1.0, "max_new_tokens": 12}
    for step, (path, spied) in enumerate(zip(files, recorded.spied, strict=True)):
        saved = torch.load(path, weights_only=True)  # plain tensors and dicts only
        assert saved["rollout_step"] == step and saved["policy_version"] == spied["version"]
        train = saved["train"]
        assert torch.equal(train["input_ids"], spied["input_ids"])
        # log π_v: the module's own π_prox log-probs of the step, to the bit
        assert torch.equal(train["target_logprobs"], spied["proximal"])
        assert train["mask"].dtype == torch.bool and train["mask"].any()
        assert (
            train["behavior_logprobs"].shape
            == train["input_ids"].shape
            == (8, spied["input_ids"].shape[1])
        )


def test_the_on_policy_batch_is_sampled_and_scored_by_pi_v(recorded):
    tokenizer = load_tokenizer("tiny-char")
    model = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=HIDDEN, num_layers=LAYERS)
    model.eval()
    versions_seen = set()
    for path, spied in zip(version_files(recorded.stream), recorded.spied, strict=True):
        saved = load_version(path)
        fresh = saved["on_policy"]
        mask = fresh["mask"]
        assert len(mask) == ROWS and mask.any(dim=1).all()
        assert (fresh["versions"][mask] == saved["policy_version"]).all()
        model.load_state_dict(spied["actor"])
        with torch.no_grad():
            expected = token_logprobs(model, fresh["input_ids"], fresh["attention_mask"])[0]
        torch.testing.assert_close(
            fresh["behavior_logprobs"][mask], expected[mask], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            fresh["target_logprobs"][mask], expected[mask], atol=1e-5, rtol=0
        )
        versions_seen.add(saved["policy_version"])
    assert versions_seen == {0, 1}  # π_v moved after the warm-up step


def test_every_variant_trains_on_the_recorded_stream_from_the_runs_initial_critic(recorded):
    meta = load_meta(recorded.stream)
    critic = shadow_critics.initial_critic(meta)  # SHA-256 checked against the run's
    assert type(critic).__name__ == meta["critic"]["class"].rsplit(".", 1)[1]
    for variant in shadow_critics.VARIANTS:
        rows = shadow_critics.train_variant(recorded.stream, variant, 1)
        assert [r["version"] for r in rows] == [1, 2, 3]
        assert all(math.isfinite(r["value_mse_mc"]) and r["tokens"] > 0 for r in rows)
    other = {**meta, "critic": {**meta["critic"], "seed": meta["critic"]["seed"] + 1}}
    with pytest.raises(ValueError, match=r"differs from the recorded run's initial critic"):
        shadow_critics.initial_critic(other)
    drift = shadow_critics.drift_statistics(recorded.stream)
    assert drift[1]["abs_max"] < 1e-5  # step 1 trains on version 0's samples with π = version 0
    assert drift[2]["abs_mean"] > 1e-4  # step 2: µ = version 0, π_v = version 1


def _offline_gae_critic(stream: Path, budget: int) -> dict[str, torch.Tensor]:
    """The weights of the GAE(1) critic trained offline on ``stream`` at ``budget``."""
    built = []

    def build(meta):
        built.append(shadow_critics.initial_critic(meta))
        return built[-1]

    shadow_critics.train_variant(stream, "gae", budget, build_critic=build)
    return built[0].state_dict()


def _largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def test_the_offline_gae_critic_at_the_recipes_budget_is_the_runs_own_critic(recorded):
    """GAE(1) with 2 steps per version on the recorded stream repeats what the run's critic did
    (same initial weights, targets, loss, optimizer and clip), up to float32 summation order."""
    initial = shadow_critics.initial_critic(load_meta(recorded.stream)).state_dict()
    assert _largest_gap(recorded.critic, initial) > 1e-3  # the run's critic did move
    assert _largest_gap(_offline_gae_critic(recorded.stream, 2), recorded.critic) < 1e-5  # ~1e-7
    assert _largest_gap(_offline_gae_critic(recorded.stream, 3), recorded.critic) > 1e-3  # ~7e-3


def test_the_recorder_refuses_the_async_data_module_and_a_bad_row_count():
    with pytest.raises(ValueError, match=r"^ShadowRecorder got on_policy_rows=0; expected"):
        ShadowRecorder("unused", on_policy_rows=0)
    trainer = types.SimpleNamespace(datamodule=object())
    with pytest.raises(ValueError, match=r"expected brace_lightning.data.RolloutDataModule"):
        ShadowRecorder("unused")._check(trainer, None)


# ---------------------------------------------------------------- the offline update, float64


class TableCritic(nn.Module):
    """V(prefix ending at column t) = table[input_ids[t]]: one float64 parameter per token id."""

    def __init__(self, vocab: int, generator: torch.Generator) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.rand(vocab, generator=generator, dtype=torch.float64))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return torch.where(attention_mask.bool(), self.table[input_ids], 0.0)


def _batch(generator: torch.Generator, vocab: int = 7) -> tuple[RolloutBatch, torch.Tensor]:
    """Three rows (left-padded prompts, right-padded responses, terminal rewards) with log π far
    from log µ, so a target that swapped them would differ."""
    attention = torch.tensor(
        [[0, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool
    )  # fmt: skip
    mask = torch.zeros_like(attention)
    mask[:, 3:] = attention[:, 3:]
    ids = torch.randint(vocab, attention.shape, generator=generator)
    behavior = torch.where(
        mask, -torch.rand(mask.shape, generator=generator, dtype=torch.float64), 0.0
    )
    target = torch.where(
        mask,
        behavior + 0.6 * torch.randn(mask.shape, generator=generator, dtype=torch.float64),
        0.0,
    )
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    for row, last in enumerate([6, 7, 5]):  # the last action of each row
        rewards[row, last] = float(row % 2)
    batch = RolloutBatch(
        input_ids=ids, attention_mask=attention, mask=mask, behavior_logprobs=behavior,
        versions=torch.where(mask, 0, -1), rewards=rewards, scores=rewards.sum(1),
        group_ids=torch.arange(3),
    )  # fmt: skip
    return batch, target


def _shifted(critic: TableCritic, batch: RolloutBatch) -> torch.Tensor:
    """The value of the state before each action, read one column to its left (by hand)."""
    values = torch.zeros(batch.mask.shape, dtype=torch.float64)
    for b, t in batch.mask.nonzero().tolist():
        values[b, t] = critic.table[batch.input_ids[b, t - 1]].detach()
    return values


def _realized(batch: RolloutBatch) -> torch.Tensor:
    returns = torch.zeros(batch.mask.shape, dtype=torch.float64)
    for b, t in batch.mask.nonzero().tolist():
        returns[b, t] = sum(
            batch.rewards[b, s] for s in range(t, batch.mask.shape[1]) if batch.mask[b, s]
        )
    return returns


@pytest.mark.parametrize("variant", list(shadow_critics.VARIANTS))
def test_one_sgd_step_is_the_regression_step_on_the_variants_targets(variant):
    generator = torch.Generator().manual_seed(3)
    batch, target_logprobs = _batch(generator)
    critic = TableCritic(7, generator)
    before = critic.table.detach().clone()
    values = _shifted(critic, batch)
    targets = shadow_critics.VARIANTS[variant]()(
        rewards=batch.rewards, values=values, target_logprobs=target_logprobs,
        behavior_logprobs=batch.behavior_logprobs, mask=batch.mask, group_ids=batch.group_ids,
    ).returns  # fmt: skip
    if variant == "gae":  # GAE(1), γ = 1: the Monte-Carlo return
        torch.testing.assert_close(targets[batch.mask], _realized(batch)[batch.mask])
    lr = 0.5
    scorer = Scorer(micro_batch_size=2, max_tokens=None, pack_sequences=False)
    scorer.prepare(critic, None, ())
    shadow_critics.critic_update(
        critic, torch.optim.SGD(critic.parameters(), lr=lr), scorer, batch, target_logprobs,
        shadow_critics.VARIANTS[variant](), steps=1, critic_loss=CriticLoss(clip=0.5),
        max_grad_norm=None,
    )  # fmt: skip
    count = int(batch.mask.sum())
    expected = before.clone()
    for b, t in batch.mask.nonzero().tolist():  # ½ (V − y)² / N, one gradient step
        expected[batch.input_ids[b, t - 1]] -= lr * (values[b, t] - targets[b, t]) / count
    torch.testing.assert_close(critic.table.detach(), expected, rtol=0, atol=1e-12)
    assert not torch.equal(expected, before)


def test_the_score_is_the_per_token_squared_error_to_the_realized_return():
    generator = torch.Generator().manual_seed(5)
    batch, _ = _batch(generator)
    critic = TableCritic(7, generator)
    scorer = Scorer(micro_batch_size=None, max_tokens=None, pack_sequences=False)
    scorer.prepare(critic, None, ())
    scores = shadow_critics.score_on_policy(critic, scorer, batch)
    values, realized = _shifted(critic, batch), _realized(batch)
    errors = [(values[b, t] - realized[b, t]).item() for b, t in batch.mask.nonzero().tolist()]
    assert scores["tokens"] == len(errors) == 12
    assert scores["value_mse_mc"] == pytest.approx(sum(e * e for e in errors) / 12, rel=1e-12)
    assert scores["value_bias_mc"] == pytest.approx(sum(errors) / 12, rel=1e-12)
    # action indices 0-7 are the bin 0-8: every action of these short rows
    assert scores["value_bias_pos0_8"] == pytest.approx(sum(errors) / 12, rel=1e-12)


# ---------------------------------------------------------------- aggregation


def test_the_window_pools_tokens_of_the_chosen_versions():
    rows = [
        {"version": 1, "value_mse_mc": 9.0, "tokens": 10},
        {"version": 2, "value_mse_mc": 0.1, "tokens": 10},
        {"version": 3, "value_mse_mc": 0.4, "tokens": 30},
    ]
    assert shadow_critics.window_mse(rows, 2, 3) == pytest.approx((1.0 + 12.0) / 40)
    assert math.isnan(shadow_critics.window_mse(rows, 4, 9))


def test_the_primary_family_is_holm_adjusted_with_the_preregistered_verdicts():
    runs = [f"warm{w}/seed{s}" for w in (0, 1) for s in (0, 1, 2)]
    wobble = [0.0004, -0.0003, 0.0001, -0.0002, 0.0003, -0.0003]
    gae = {run: 0.15 + 0.01 * i for i, run in enumerate(runs)}
    shifts = {
        "vtrace": [-0.02 + w for w in wobble],  # beyond the margin below 0: better
        "gae_l095": [0.03 + w for w in wobble],  # beyond the margin above 0: worse
        "brace_k10": [0.0005 * w / 0.0004 for w in wobble],  # inside ±0.005: a tie
        "brace_k100": [0.02, -0.02, 0.015, -0.01, 0.0, -0.005],  # wide: inconclusive
        "brace_kinf": [0.005 + w for w in wobble],  # excludes 0, not the margin: inconclusive
        "brace_notail": [0.002 + w / 4 for w in wobble],  # excludes 0 but inside ±0.005: a tie
        "brace_lb2": [w / 2 for w in wobble],
    }
    values = {("gae", 8): gae}
    for variant, shift in shifts.items():
        values[(variant, 8)] = {run: gae[run] + d for run, d in zip(runs, shift, strict=True)}
    rows = {row[0]: row for row in shadow_critics.primary_table(values, 8)}
    assert list(rows) == [v for v in shadow_critics.VARIANTS if v != "gae"]  # 7 comparisons
    verdicts = {variant: row[5] for variant, row in rows.items()}
    assert verdicts["vtrace"] == "better" and verdicts["gae_l095"] == "worse"
    assert verdicts["brace_k10"] == "tie (±0.005)" == verdicts["brace_notail"]
    assert verdicts["brace_k100"].startswith("inconclusive (±")
    assert verdicts["brace_kinf"].startswith("inconclusive (±")
    assert all(row[1] == 6 for row in rows.values())  # paired by recorded run
    # Holm: the smallest p is multiplied by the family's size, 7
    p = {variant: float(row[3]) for variant, row in rows.items()}
    holm_p = {variant: float(row[4]) for variant, row in rows.items()}
    smallest = min(p, key=p.get)
    assert holm_p[smallest] == pytest.approx(min(1.0, 7 * p[smallest]), rel=1e-2)
    assert "(99.29%)" in rows[smallest][2]  # its interval at level 1 − 0.05 / 7
    assert shadow_critics.primary_table(values, 2) == []  # no runs at that budget


def test_the_docstring_and_the_results_page_state_the_preregistered_primary_verbatim():
    text = shadow_critics.PRIMARY_TEXT
    assert text in " ".join(shadow_critics.__doc__.split())
    results = " ".join((ROOT / "docs" / "results_lm.md").read_text().split())
    assert text in results and "pre-registered by the lead on 2026-12-06" in results


# ---------------------------------------------------------------- the documented command, short


@pytest.mark.slow
def test_the_commands_record_train_aggregate_and_resume(tmp_path, capsys):
    """The documented commands' short form: ``--only record``, ``--only train``, the whole
    experiment (everything already there: nothing runs again) and ``--only aggregate``."""
    out = tmp_path / "shadow"
    fake_warm_start(lm_map.warm_folder(out, 0))
    argv = ["--out", str(out), "--warm-seeds", "0", "--seeds", "0", "--steps", "2", "--every", "2"]
    argv += ["--on-policy-rows", "2", "--budgets", "1", "--variants", "gae", "brace_k100"]
    argv += ["--primary-versions", "2", "2", "--config", str(tiny_recipe(tmp_path / "tiny.yaml"))]
    cell = shadow_critics.record_cell(0, 0)
    shadow_critics.main([*argv, "--only", "record"])
    printed = capsys.readouterr().out
    assert f"record {cell}: done" in printed and "train " not in printed
    marker = json.loads((cell.folder(out) / "done.json").read_text())
    assert "--data.init_args.lag=4" in marker["args"]
    assert "--model.actor_optimizer.init_args.lr=5e-05" in marker["args"]
    assert any(arg.endswith("targets/gae.yaml") for arg in marker["args"])
    assert len(version_files(cell.folder(out) / "stream")) == 2
    shadow_critics.main([*argv, "--only", "train", "--workers", "2"])  # two processes
    printed = capsys.readouterr().out
    assert "train warm0/seed0 brace_k100 budget 1: done in" in printed and "record " not in printed
    assert "train warm0/seed0 gae budget 1: done in" in printed
    scores = json.loads((out / "scores.json").read_text())
    assert [r["version"] for r in scores["warm0/seed0"]["brace_k100"]["1"]] == [1, 2]
    summary = (out / "summary.md").read_text()
    assert "fewer than 2 paired runs" in summary and "Not the pre-registered window" in summary
    shadow_critics.main(argv)
    printed = capsys.readouterr().out
    assert f"record {cell}: every critic is in" in printed and "budget 1: skipped" in printed
    assert "budget 1: done" not in printed
    shadow_critics.main([*argv, "--only", "aggregate"])
    printed = capsys.readouterr().out
    assert "train " not in printed and "record " not in printed and "### Primary outcome" in printed
    # Every finished file is kept under OUT/records/<run>/ with the stream's digest: on a machine
    # without the recording nothing is recorded or trained again, and the scores are the same.
    kept = out / "records" / "warm0" / "seed0"
    stream = version_files(cell.folder(out) / "stream")
    digest = json.loads((kept / "stream.json").read_text())["sha256"]
    assert digest == stream_sha256(cell.folder(out) / "stream")
    for name in ("gae_b1.json", "brace_k100_b1.json", "drift.json"):
        assert (kept / "critics" / name).read_bytes() == (
            cell.folder(out) / "critics" / name
        ).read_bytes()
    elsewhere = tmp_path / "elsewhere"
    shadow_critics.main(["--out", str(elsewhere), *argv[2:], "--records", str(out / "records")])
    printed = capsys.readouterr().out
    assert f"record {cell}: every critic is in" in printed and "train " not in printed
    assert not (elsewhere / "warm0").exists()
    assert json.loads((elsewhere / "scores.json").read_text()) == scores
    # A record of another stream is refused: critics of two streams are never pooled.
    (kept / "critics" / "gae_b1.json").unlink()
    (kept / "stream.json").write_text(json.dumps({"sha256": "0" * 64}))
    with pytest.raises(SystemExit, match="is not the one the records in .* were trained on"):
        shadow_critics.main([*argv, "--only", "train"])
    assert len(stream) == 2


def test_the_stream_digest_follows_the_recorded_tensors(tmp_path):
    """stream_sha256: equal for a byte-for-byte copy in another folder, different when one
    value of one tensor changes."""
    import torch

    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
        for step in (1, 2):
            saved = {"rollout_step": step, "train": {"rewards": torch.tensor([0.0, 1.0])}}
            torch.save(saved, folder / f"v{step:05d}.pt")
    (second / "meta.json").write_text("{}")  # not in the digest
    assert stream_sha256(first) == stream_sha256(second)
    torch.save(
        {"rollout_step": 2, "train": {"rewards": torch.tensor([0.0, 0.5])}}, second / "v00002.pt"
    )
    assert stream_sha256(first) != stream_sha256(second)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budgets", "0"], "argument --budgets: expected an integer >= 1; got '0'"),
        (["--steps", "30", "--every", "20"], "--steps (30) must be a multiple of --every (20)."),
        (
            ["--primary-versions", "9", "3"],
            "--primary-versions must be 1 < FIRST <= LAST; got 9 3.",
        ),
    ],
)
def test_the_command_refuses_bad_arguments_in_one_sentence(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        shadow_critics.main(["--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_the_summary_tabulates_the_primary_and_the_secondary_windows():
    def rows(level: float, late: float) -> list[dict[str, float]]:
        return [
            {"version": v, "value_mse_mc": level if v < 3 else late, "tokens": 10,
             "value_bias_mc": 0.1, "value_bias_pos8_32": 0.3, "value_bias_pos0_8": 0.2}
            for v in (1, 2, 3, 4)
        ]  # fmt: skip

    scores = {
        f"warm0/seed{s}": {
            "gae": {2: rows(0.20 + s / 100, 0.20 + s / 100)},
            "vtrace": {2: rows(0.20 + s / 100 + 0.0001 * s, 0.15 + s / 100 + 0.001 * s)},
        }
        for s in range(3)
    }
    drift = {"warm0/seed0": [{k: 1.0 for k in ("abs_mean", "abs_p50", "abs_p90", "abs_p99",
                                               "product_mean", "window_mean")}]}  # fmt: skip
    text = shadow_critics.summary(scores, drift, [2], (3, 4))
    primary = text.split("**budget 2 critic steps per version**")[1].split("**secondary")[0]
    assert "| vtrace | 3 |" in primary and "better" in primary  # −0.049 ± ~0.01 beyond −0.005
    early = text.split("over versions 1–2 (95% CI, unadjusted)**")[1].split("**secondary")[0]
    assert "| 2 | vtrace | +0.0001" in early and "tie (±0.005)" in early
    bias = text.split("signed mean (V − G) over versions 3–4")[1].split("**secondary")[0]
    assert "value_bias_mc | value_bias_pos0_8 | value_bias_pos8_32 |" in bias  # by position
    assert "Not the pre-registered window" in text
    assert "| warm0/seed0 | 1 | 1 | 1 | 1 | 1 | 1 |" in text
