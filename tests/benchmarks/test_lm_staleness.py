"""The LM staleness grid runner (``benchmarks/lm_staleness.py``): cells, resume, aggregation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchmarks import lm_staleness
from benchmarks.lm_staleness import Cell, score, summarize, window_mean

ROOT = Path(__file__).resolve().parents[2]


def test_summarize_known_interval() -> None:
    # Seeds 0..2: GAE rewards 0.1, 0.2, 0.3; BRACE 0.3, 0.5, 0.4 -> diffs 0.2, 0.3, 0.1.
    # Mean diff 0.2, std 0.1, half-width t_{0.975,2} * 0.1 / sqrt(3) = 4.303 * 0.057735 = 0.24843.
    scores = {
        (0, "gae"): {0: 0.1, 1: 0.2, 2: 0.3},
        (0, "brace"): {0: 0.3, 1: 0.5, 2: 0.4},
        (8, "gae"): {0: 0.0, 1: 0.0, 2: 0.0},
        (8, "brace"): {0: 1.0, 1: 1.1, 2: 0.9},
    }
    rows = summarize(scores, higher_is_better=True)
    brace = rows[(0, "brace")]
    assert brace["mean"] == pytest.approx(0.4)
    assert brace["low"] == pytest.approx(0.4 - 0.24843, abs=1e-4)
    assert brace["high"] == pytest.approx(0.4 + 0.24843, abs=1e-4)
    assert brace["diff"] == pytest.approx(0.2)
    assert brace["diff_low"] == pytest.approx(0.2 - 0.24843, abs=1e-4)
    assert brace["verdict"] == "inconclusive (±0.248)"  # covers 0; no margin stated: not a tie
    assert rows[(8, "brace")]["verdict"] == "better"  # paired with GAE at the same lag only
    assert "diff" not in rows[(0, "gae")]
    # Lower is better (the value gap): the same difference is then worse.
    assert summarize(scores, higher_is_better=False)[(8, "brace")]["verdict"] == "worse"


def test_summarize_single_seed_has_no_interval() -> None:
    rows = summarize({(0, "gae"): {0: 0.5}, (0, "vtrace"): {0: 0.7}}, higher_is_better=True)
    assert rows[(0, "vtrace")]["mean"] == 0.7
    assert "diff" not in rows[(0, "vtrace")]  # one paired seed: no interval, no verdict


def test_window_mean() -> None:
    series = [(3, 4.0), (0, 1.0), (1, 2.0), (2, 3.0)]
    assert window_mean(series, 2) == 3.5  # the last two steps, by step
    assert window_mean(series, 2, first=True) == 1.5
    assert window_mean(series, 10) == 2.5
    dip = [(step, value) for step, value in enumerate([0.5, 0.5, 0.1, 0.2, 0.6, 0.4, 0.3])]
    assert score(dip, "worst", 2) == pytest.approx(0.15)  # windows 0.5, 0.15, 0.5, 0.3
    # windows 0.367, 0.4 and a short last one, 0.3
    assert score(dip, "worst", 3) == pytest.approx(0.3)
    assert score(dip, "mean", 2) == pytest.approx(2.6 / 7)
    assert score(dip, "last", 2) == 0.3
    assert score(dip, "first", 2) == 0.5 and score(dip, "final", 2) == pytest.approx(0.35)


def test_targets_differ_only_in_their_target_arguments(tmp_path: Path) -> None:
    recipe = ROOT / "configs" / "evidence" / "long_arith.yaml"
    commands = {}
    for target, selected in lm_staleness.TARGETS.items():
        args = lm_staleness.command(
            Cell(8, target, 1), tmp_path, steps=40, every=20, recipe=recipe, extra=[]
        )
        start = args.index("brace_lightning.cli") + 4  # after the module, fit and two options
        assert args[start : start + len(selected)] == selected
        rest = args[:start] + args[start + len(selected) :]
        assert f"--trainer.logger.init_args.save_dir={Cell(8, target, 1).folder(tmp_path)}" in rest
        commands[target] = [a for a in rest if "save_dir=" not in a]
        assert "--data.init_args.lag=8" in args and "--trainer.max_epochs=2" in args
    first = commands.pop("gae")
    assert all(other == first for other in commands.values())  # same recipe, seeds and lag
    # the no-tail overlay is the paper's BRACE with the tail off, nothing else
    overlays = {
        name: yaml.safe_load((ROOT / "configs" / "targets" / f"{name}.yaml").read_text())
        for name in ("brace", "brace_notail")
    }
    notail = overlays["brace_notail"]["model"]["value_target"]["init_args"]
    assert notail.pop("mc_tail") is False
    assert overlays["brace"]["model"]["value_target"]["init_args"] == {**notail, "mc_tail": True}
    # the ρ ablations change the advantage's ρ factor of their base target, nothing else
    for name, base, flag in (("brace_rho", "brace", True), ("vtrace_norho", "vtrace", False)):
        paths = {n: ROOT / "configs" / "targets" / f"{n}.yaml" for n in (name, base)}
        ablation, original = (yaml.safe_load(paths[n].read_text())["model"] for n in (name, base))
        assert ablation["value_target"]["init_args"].pop("rho_in_advantage") is flag
        assert ablation == original


def tiny_recipe(path: Path) -> Path:
    """The long-arithmetic recipe cut to seconds: 2 prompts x 2 samples of at most 6 tokens."""
    recipe = yaml.safe_load((ROOT / "configs" / "evidence" / "long_arith.yaml").read_text())
    init = recipe["data"]["init_args"]
    init.update(prompts_per_step=2, samples_per_prompt=2, val_batches=1)
    init["task"]["init_args"].update(num_operands=2)
    init["engine"]["init_args"]["max_new_tokens"] = 6
    recipe["model"].update(ppo_epochs=1, num_minibatches=1, critic_warmup_steps=1)
    path.write_text(yaml.safe_dump(recipe))
    return path


def fake_warm_start(out: Path) -> None:
    """A random tiny actor where the runner looks for the shared warm start (saves one ``fit``)."""
    from brace_lightning.models import load_tokenizer
    from brace_lightning.models.sources import load_actor

    tokenizer = load_tokenizer("tiny-char")
    actor = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=32, num_layers=1)
    actor.save_pretrained(lm_staleness.warm_actor(out))
    tokenizer.save_pretrained(lm_staleness.warm_actor(out))


@pytest.mark.slow
def test_grid_runs_resumes_and_tabulates(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    recipe = tiny_recipe(tmp_path / "tiny.yaml")
    out = tmp_path / "grid"
    fake_warm_start(out)
    argv = ["--out", str(out), "--config", str(recipe), "--seeds", "0", "--lags", "0", "1"]
    argv += ["--targets", "gae", "--steps", "2", "--every", "1", "--window", "2"]
    lm_staleness.main(argv)
    printed = capsys.readouterr().out
    cells = [Cell(0, "gae", 0), Cell(1, "gae", 0)]
    for cell in cells:
        assert f"{cell}: done" in printed
        marker = json.loads((cell.folder(out) / "done.json").read_text())
        assert f"--data.init_args.lag={cell.lag}" in marker["args"]
        series = lm_staleness.read_cell(cell.folder(out))
        assert [step for step, _ in series["rollout/reward"]] == [1, 2]
        assert len(series["val/value_mse_mc"]) == 2  # validated after each 1-step epoch
    summary = (out / "summary.md").read_text()
    for name, _, _, _ in lm_staleness.METRICS:
        section = summary.split(f"**{name}**")[1].split("**")[0].strip().splitlines()
        rows = [line.split(" | ")[:3] for line in section[2:]]
        assert rows == [["| 0", "gae", "1"], ["| 1", "gae", "1"]], name
    per_run = summary.split("**per run**")[1].strip().splitlines()
    assert [line.split(" | ")[:3] for line in per_run[2:]] == [
        ["| 0", "gae", "0"],
        ["| 1", "gae", "0"],
    ]
    for line in per_run[2:]:  # two validation passes, then the zero-reward batch count (of 2)
        validation, zeros = line.split(" | ")[3:5]
        assert validation.count(" → ") == 1 and int(zeros) in (0, 1, 2), line
    assert (out / "curves.png").stat().st_size > 0

    lm_staleness.main(argv)  # rerun: every cell has its marker
    printed = capsys.readouterr().out
    assert all(f"{cell}: skipped" in printed for cell in cells)
    assert "missing cells" not in printed


def test_job_parameters_parse_key_value_pairs_and_name_a_bad_one() -> None:
    assert lm_staleness.job_parameters(["slurm_partition=cpu", "timeout_min=60"]) == {
        "slurm_partition": "cpu",
        "timeout_min": 60,
    }
    with pytest.raises(ValueError, match=r"^--job takes KEY=VALUE pairs .*; got 'timeout_min'\.$"):
        lm_staleness.job_parameters(["timeout_min"])


def test_submitit_options_without_the_submitit_launcher_are_one_error(tmp_path, capsys) -> None:
    """--cluster and --job would be ignored by the local threads: refused, not dropped."""
    with pytest.raises(SystemExit):
        lm_staleness.main(["--out", str(tmp_path), "--job", "timeout_min=10"])
    assert (
        "--cluster and --job configure --launcher submitit; got --cluster None --job "
        "timeout_min=10 with --launcher local" in capsys.readouterr().err
    )
    assert not any(tmp_path.iterdir())  # nothing ran, nothing was written


def test_submit_grid_hands_the_cluster_and_job_parameters_to_submitit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recording stand-in for submitit's executor (isolates the hand-over; the real executor
    runs in the test below): --cluster and --job reach it, the warm start goes first."""
    import submitit

    seen: dict[str, object] = {}
    calls: list[object] = []

    class Done:
        def __init__(self, value: object) -> None:
            self.value = value

        def result(self) -> object:
            return self.value

    class Recorder:
        def __init__(self, folder: Path, cluster: str | None) -> None:
            seen.update(folder=folder, cluster=cluster)

        def update_parameters(self, **parameters: object) -> None:
            seen.update(parameters)

        def submit(self, fn, *args):
            calls.append(args[0] if args else "warm")
            return Done(fn(*args))

    monkeypatch.setattr(submitit, "AutoExecutor", Recorder)
    cells = [Cell(1, "gae", 0), Cell(1, "vtrace", 0)]
    statuses = lm_staleness.submit_grid(
        cells,
        lambda: None,
        lambda cell: f"ran {cell.target}",
        folder=tmp_path,
        cluster="debug",
        parameters=lm_staleness.job_parameters(["slurm_partition=cpu", "timeout_min=60"]),
    )
    assert seen == {
        "folder": tmp_path / "%j",
        "cluster": "debug",
        "name": "lm_staleness",
        "slurm_partition": "cpu",
        "timeout_min": 60,
    }
    assert calls == ["warm", *cells]
    assert statuses == [(cells[0], "ran gae"), (cells[1], "ran vtrace")]


@pytest.mark.slow
def test_the_grid_runs_as_submitit_jobs_and_resumes(tmp_path: Path, capsys) -> None:
    """``--launcher submitit`` with submitit's local cluster: real jobs (pickled ``run_cell`` calls
    in fresh processes), the same cells and markers as the local threads, logs under submitit/."""
    recipe = tiny_recipe(tmp_path / "tiny.yaml")
    out = tmp_path / "grid"
    fake_warm_start(out)
    argv = ["--out", str(out), "--config", str(recipe), "--seeds", "0", "--lags", "1"]
    argv += ["--targets", "gae", "vtrace", "--steps", "2", "--every", "1", "--window", "2"]
    argv += ["--launcher", "submitit", "--cluster", "local", "--job", "timeout_min=10"]
    lm_staleness.main(argv)
    printed = capsys.readouterr().out
    cells = [Cell(1, "gae", 0), Cell(1, "vtrace", 0)]
    for cell in cells:
        assert f"{cell}: done" in printed
        assert (cell.folder(out) / "done.json").exists()
        assert len(lm_staleness.read_cell(cell.folder(out))["rollout/reward"]) == 2
    assert len(list((out / "submitit").rglob("*_log.out"))) == 3  # the warm start, two cells
    assert "missing cells" not in printed
    lm_staleness.main(argv)  # rerun: each job finds its cell's marker
    printed = capsys.readouterr().out
    assert all(f"{cell}: skipped" in printed for cell in cells)
