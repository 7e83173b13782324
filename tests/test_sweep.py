"""The sweep harness: a tiny grid end to end, and aggregation on results with known intervals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from brace_lightning.sweep import aggregate, cells, collect, interval, main


def test_interval_matches_student_t_by_hand() -> None:
    # samples 1, 2, 3: mean 2, sd 1, t_{0.975, 2} = 4.303 -> half-width 4.303 / sqrt(3).
    mean, low, high = interval([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert high - mean == pytest.approx(4.303 / math.sqrt(3))
    assert mean - low == pytest.approx(4.303 / math.sqrt(3))
    with pytest.raises(ValueError, match="at least 2 values"):
        interval([1.0])


def test_aggregate_pairs_by_seed_and_reports_ties() -> None:
    reference = {0: 1.0, 1: 5.0, 2: 9.0}  # wide across seeds
    scores = {
        "target=ref,S=1": reference,
        "target=a,S=1": {s: v - 1.0 + 0.01 * s for s, v in reference.items()},  # paired: -1 ± small
        "target=b,S=1": {0: 1.5, 1: 4.0, 2: 9.6},  # diffs 0.5, -1, 0.6 -> covers 0
    }
    rows = {r["setting"]: r for r in aggregate(scores, "ref")}
    a = rows["target=a,S=1"]
    assert a["verdict"] == "better"
    diff_mean, diff_low, diff_high = interval([-1.0, -0.99, -0.98])
    assert (a["diff"], a["diff_low"], a["diff_high"]) == pytest.approx(
        (diff_mean, diff_low, diff_high)
    )
    assert rows["target=b,S=1"]["verdict"] == "tie"
    assert rows["target=ref,S=1"]["verdict"] is None
    # Unpaired, a's interval would overlap ref's: the pairing is what makes it a difference.
    assert a["low"] < rows["target=ref,S=1"]["high"]


def test_tiny_grid_runs_resumes_and_summarizes(tmp_path: Path) -> None:
    grid = Path(__file__).parent.parent / "sweeps" / "tiny.yaml"
    spec = yaml.safe_load(grid.read_text())
    main([str(grid), str(tmp_path), "--workers", "1"])
    assert len(list(tmp_path.glob("*/log.json"))) == len(cells(spec)) == 12
    for png in ("summary_gap_pi.png", "curves_gap_pi.png", "beta.png"):
        assert (tmp_path / png).stat().st_size > 0
    assert (
        "tie" in (tmp_path / "summary.md").read_text()
        or "better" in (tmp_path / "summary.md").read_text()
        or "worse" in (tmp_path / "summary.md").read_text()
    )
    first = next(iter(tmp_path.glob("*/log.json")))
    stamp = first.stat().st_mtime_ns
    main([str(grid), str(tmp_path)])  # resumes: nothing reruns
    assert first.stat().st_mtime_ns == stamp
    assert len(collect(spec, tmp_path)) == 4


def test_metric_lists_and_windows_are_read_and_checked() -> None:
    from brace_lightning.sweep import metrics, score, window

    log = {"gap_pi": [4.0, 3.0, 2.0, 1.0]}
    assert score(log, "gap_pi") == 1.0  # last quarter
    assert score(log, "gap_pi", 0.5) == 1.5
    assert score(log, "gap_pi", 1.0) == 2.5  # the whole run
    assert metrics({"metric": ["gap_pi", "reward"]}) == ["gap_pi", "reward"]
    assert metrics({"metric": "gap_pi"}) == ["gap_pi"]
    assert window({}) == 0.25
    with pytest.raises(ValueError, match="window must be a fraction in \\(0, 1\\]; got 0"):
        window({"window": 0})
    with pytest.raises(ValueError, match="metric must be a field name or a list of them; got 3"):
        metrics({"metric": 3})


def test_variants_bundle_fields_and_name_their_cells() -> None:
    spec = {
        "base": {"horizon": 8, "critic_lr": 0.9},
        "grid": {"seed": [0, 1]},
        "variants": {"tab": {"critic": "tabular"}, "mlp": {"critic": "mlp", "critic_lr": 0.01}},
        "targets": {"gae": {"class_path": "GAE"}},
        "objectives": {"ppo": {"class_path": "PPOClip"}},
        "metric": "gap_pi",
    }
    by_name = {cell["name"]: cell for cell in cells(spec)}
    assert sorted(by_name) == [
        "target=gae,objective=ppo,variant=mlp,seed=0",
        "target=gae,objective=ppo,variant=mlp,seed=1",
        "target=gae,objective=ppo,variant=tab,seed=0",
        "target=gae,objective=ppo,variant=tab,seed=1",
    ]
    assert by_name["target=gae,objective=ppo,variant=mlp,seed=1"]["critic_lr"] == 0.01
    assert by_name["target=gae,objective=ppo,variant=tab,seed=0"]["critic_lr"] == 0.9
    assert by_name["target=gae,objective=ppo,variant=tab,seed=0"]["critic"] == "tabular"


def test_verdict_follows_the_metric_direction() -> None:
    scores = {
        "target=ref": {0: 1.0, 1: 2.0, 2: 3.0},
        "target=up": {0: 2.0, 1: 3.1, 2: 3.9},  # paired differences 1.0, 1.1, 0.9
    }
    verdicts = {
        higher: next(r for r in aggregate(scores, "ref", higher_is_better=higher) if r["diff"])[
            "verdict"
        ]
        for higher in (False, True, None)
    }
    assert verdicts == {False: "worse", True: "better", None: "differs"}


def test_shadow_grid_pairs_the_critics_of_one_run(tmp_path: Path) -> None:
    spec = {
        "base": {"horizon": 8, "versions": 6, "staleness": 2, "batch_size": 16},
        "grid": {"seed": [0, 1]},
        "targets": {
            "gae": {"class_path": "GAE"},
            "brace": {"class_path": "BRACE", "init_args": {"k": 2}},
        },
        "drivers": ["brace"],
        "shadows": ["gae", "brace"],
        "objectives": {"ppo": {"class_path": "PPOClip"}},
        "metric": "gap_pi",
        "window": 1.0,
    }
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(spec))
    main([str(grid), str(tmp_path / "out")])
    assert len(list((tmp_path / "out").glob("*/log.json"))) == 2  # one run per seed
    scores = collect(spec, tmp_path / "out")
    assert sorted(scores) == [
        "target=brace,driver=brace,objective=ppo",
        "target=gae,driver=brace,objective=ppo",
    ]
    rows = {r["setting"]: r for r in aggregate(scores, "gae")}
    shadow = rows["target=brace,driver=brace,objective=ppo"]
    assert shadow["diff"] is not None  # paired with the GAE critic of the same runs
    assert "target=brace,driver=brace" in (tmp_path / "out" / "summary.md").read_text()
