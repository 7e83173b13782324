"""The sweep harness: a tiny grid end to end, and aggregation on results with known intervals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from brace_lightning import sweep
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
    # Covering 0 is not a tie: with no margin stated it is inconclusive, with its half-width.
    b = rows["target=b,S=1"]
    assert b["verdict"] == f"inconclusive (±{(b['diff_high'] - b['diff_low']) / 2:.3g})"
    with_margin = {r["setting"]: r for r in aggregate(scores, "ref", margin=10.0)}
    assert with_margin["target=b,S=1"]["verdict"] == "tie (±10)"
    assert with_margin["target=a,S=1"]["verdict"] == "better"
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
    summary = (tmp_path / "summary.md").read_text()
    assert "### gap_pi (lower is better; secondary; unadjusted 95% intervals" in summary
    assert "inconclusive (±" in summary or "better" in summary or "worse" in summary
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


def _rows(text: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell (the setting)."""
    lines = [line for line in text.splitlines() if line.startswith("| target=")]
    return {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines}


def _two_target_scores() -> dict[str, dict[int, float]]:
    return {
        "target=ref,S=0": {0: 0.5, 1: 0.6, 2: 0.7},
        "target=new,S=0": {0: 0.8, 1: 0.91, 2: 0.99},  # +0.3 ± 0.01: clearly better
        "target=ref,S=8": {0: 0.5, 1: 0.6, 2: 0.7},
        "target=new,S=8": {0: 0.501, 1: 0.6, 2: 0.699},  # within ±0.02: a tie
        "target=ref,S=20": {0: 0.5, 1: 0.6, 2: 0.7},
        "target=new,S=20": {0: 0.9, 1: 0.3, 2: 0.8},  # wide: inconclusive
    }


def test_primary_table_is_one_holm_family_with_margin_and_its_date() -> None:
    from brace_lightning.statistics import holm, paired_t_test
    from brace_lightning.sweep import primary_table

    primary = {"date": "2026-12-06", "question": "Q?", "metric": "value_pi",
               "comparisons": ["new"], "reference": "ref", "margin": 0.02}  # fmt: skip
    text = primary_table(_two_target_scores(), primary, higher_is_better=True)
    assert "pre-registered 2026-12-06" in text and "Family: 3 comparisons" in text
    rows = _rows(text)
    assert sorted(rows) == ["target=new,S=0", "target=new,S=20", "target=new,S=8"]
    scores = _two_target_scores()
    raw = [
        paired_t_test([scores[f"target=new,S={s}"][i] - 0.5 - 0.1 * i for i in range(3)])[3]
        for s in (0, 20, 8)
    ]
    for s, p, adjusted in zip((0, 20, 8), raw, holm(raw), strict=True):
        assert float(rows[f"target=new,S={s}"][3]) == pytest.approx(p, rel=1e-2)
        assert float(rows[f"target=new,S={s}"][4]) == pytest.approx(adjusted, rel=1e-2)
    assert rows["target=new,S=0"][5].startswith("better")
    assert rows["target=new,S=8"][5].startswith("tie (±0.02)")
    assert rows["target=new,S=20"][5].startswith("inconclusive (±")


def test_survival_uses_exact_tests_paired_by_seed_or_fisher(tmp_path: Path) -> None:
    from brace_lightning.statistics import fisher_exact, mcnemar_exact
    from brace_lightning.sweep import survival_table

    spec = {"targets": {"ref": {}, "new": {}}, "reference": "ref",
            "survival": {"metric": "value_pi", "threshold": 0.05}}  # fmt: skip
    survived = {("ref", "A"): [1, 1, 1, 1, 1], ("new", "A"): [0, 0, 0, 0, 1],
                ("ref", "B"): [1, 1, 1], ("new", "B"): [1, 0, 0, 1]}  # fmt: skip
    logs = []
    for (target, setting), outcomes in survived.items():
        for seed, alive in enumerate(outcomes):
            cell = {"name": f"target={target},S={setting},seed={seed}", "seed": seed}
            logs.append((cell, {"value_pi": [0.5, 0.9 if alive else 0.0]}))
    text = survival_table(spec, logs)
    rows = _rows(text)
    assert rows["target=new,S=A"][1:3] == ["1/5 vs 5/5", "McNemar (paired)"]
    assert float(rows["target=new,S=A"][3]) == pytest.approx(mcnemar_exact(0, 4), abs=1e-3)
    assert rows["target=new,S=B"][1:3] == ["2/4 vs 3/3", "Fisher"]  # seed 3 has no pair
    assert float(rows["target=new,S=B"][3]) == pytest.approx(fisher_exact(2, 2, 3, 0), abs=1e-3)
    assert rows["target=new, all settings"][1] == "1/5 vs 5/5"  # pooled over paired settings


def test_primary_block_is_checked_and_every_sim_grid_declares_a_dated_one() -> None:
    from brace_lightning.sweep import check_primary

    spec = yaml.safe_load((Path(__file__).parent.parent / "sweeps" / "sim_drift.yaml").read_text())
    primary = check_primary(spec)
    assert primary is not None and str(primary["date"]) == "2026-12-06"
    with pytest.raises(ValueError, match="primary names the target 'nope'"):
        check_primary({**spec, "primary": {**primary, "reference": "nope"}})
    with pytest.raises(ValueError, match="primary margin must be a number > 0; got 0"):
        check_primary({**spec, "primary": {**primary, "margin": 0}})
    with pytest.raises(ValueError, match="primary must be a mapping with the keys"):
        check_primary({**spec, "primary": {"metric": "value_pi"}})
    for name in (
        "sim_drift",
        "sim_mlp_rules",
        "sim_mlp_rules_sparse",
        "sim_staleness",
        "sim_targets",
    ):
        grid = yaml.safe_load(
            (Path(__file__).parent.parent / "sweeps" / f"{name}.yaml").read_text()
        )
        assert check_primary(grid) is not None, name


def test_markers_and_copies_are_written_whole(tmp_path: Path) -> None:
    """A marker reads back as written (compact, or indented with a final newline); a copied file
    or folder appears whole under its name, and a leftover ``.partial`` from a stopped copy is
    replaced, not merged."""
    sweep.write_marker(tmp_path / "a" / "m.json", {"x": [1, 2]})
    assert (tmp_path / "a" / "m.json").read_text() == '{"x": [1, 2]}'
    sweep.write_marker(tmp_path / "n.json", {"x": 1}, indent=1)
    assert (tmp_path / "n.json").read_text() == '{\n "x": 1\n}\n'
    assert sorted(p.name for p in tmp_path.rglob("*.tmp")) == []

    sweep.copy_atomic(tmp_path / "n.json", tmp_path / "kept" / "n.json")
    assert (tmp_path / "kept" / "n.json").read_bytes() == (tmp_path / "n.json").read_bytes()
    stale = tmp_path / "copy.partial"
    stale.mkdir()
    (stale / "half_written").write_text("")
    sweep.copy_atomic(tmp_path / "a", tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["m.json"]
    assert not stale.exists()
