"""The lag × lr map harness (``benchmarks/lm_staleness_map.py``): the pre-registered outcomes, the
exact test and a 2-cell smoke run (the map itself needs ~20 CPU hours and is not run here)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import safetensors.torch
import yaml

from benchmarks import lm_staleness_map as lm_map
from benchmarks.lm_staleness_map import MapCell, Outcome, collapsed, fisher_exact
from tests.benchmarks.test_lm_staleness import fake_warm_start, tiny_recipe

ROOT = Path(__file__).resolve().parents[2]


def _slow_fisher(table: tuple[tuple[int, int], tuple[int, int]]) -> float:
    """Every 2×2 table with the same margins, enumerated, probabilities from factorials."""
    (a, b), (c, d) = table
    n = a + b + c + d

    def prob(x: int) -> float:
        y, z = a + b - x, a + c - x
        w = n - x - y - z
        return (
            math.factorial(a + b) * math.factorial(c + d) * math.factorial(a + c)
            * math.factorial(b + d)
            / (math.factorial(n) * math.factorial(x) * math.factorial(y) * math.factorial(z)
               * math.factorial(w))
        )  # fmt: skip

    observed = prob(a)
    total = 0.0
    for x in range(0, a + b + 1):
        if a + c - x < 0 or n - x - (a + b - x) - (a + c - x) < 0 or a + c - x > c + d:
            continue
        if prob(x) <= observed * (1 + 1e-7):
            total += prob(x)
    return min(1.0, total)


@pytest.mark.parametrize(
    "table",
    [((5, 0), (0, 5)), ((3, 1), (1, 3)), ((0, 5), (0, 5)), ((1, 4), (5, 0)), ((2, 3), (4, 6))],
)
def test_fisher_exact_matches_an_enumeration_and_known_values(table):
    assert math.isclose(fisher_exact(table), _slow_fisher(table), rel_tol=1e-12)


def test_fisher_exact_known_values_and_scipy():
    assert math.isclose(fisher_exact(((5, 0), (0, 5))), 2 / 252, rel_tol=1e-12)
    assert math.isclose(fisher_exact(((3, 1), (1, 3))), 34 / 70, rel_tol=1e-12)
    assert fisher_exact(((0, 5), (0, 5))) == 1.0
    with pytest.raises(ValueError, match=r"^table must hold counts >= 0"):
        fisher_exact(((-1, 2), (3, 4)))
    stats = pytest.importorskip("scipy.stats")
    for table in (((5, 0), (1, 4)), ((2, 3), (4, 6)), ((7, 3), (2, 8))):
        assert math.isclose(fisher_exact(table), stats.fisher_exact(table)[1], rel_tol=1e-9)


def test_the_collapse_rule_is_twenty_of_the_last_forty_batches_at_zero():
    alive = [(step, 0.0 if step % 3 else 0.5) for step in range(200)]  # 26 of the last 40 at 0
    assert collapsed(alive)
    recovered = [(step, 0.0) for step in range(160)] + [(s, 0.1) for s in range(160, 181)]
    recovered += [(s, 0.0) for s in range(181, 200)]  # 19 of the last 40 at 0
    assert not collapsed(recovered)
    assert collapsed(recovered[:-1] + [(199, 0.0), (200, 0.0)])  # one more zero: 20 of 40
    assert not collapsed([(0, 0.0)] * 19)  # fewer than 20 batches cannot collapse


def test_the_map_tables_count_survivors_and_test_the_configurations():
    outcomes = {}
    for seed in range(5):
        outcomes[MapCell("recipe", "gae", 8, 2e-4, 0, seed)] = Outcome(False, 0.0)
        outcomes[MapCell("stable", "gae", 8, 2e-4, 0, seed)] = Outcome(True, 0.4)
        outcomes[MapCell("stable", "gae", 0, 2e-4, 0, seed)] = Outcome(True, 0.5 + seed / 100)
        outcomes[MapCell("stable_rho", "gae", 8, 2e-4, 0, seed)] = Outcome(seed > 0, 0.4)
    outcomes[MapCell("stable_rho", "gae", 16, 2e-4, 0, 0)] = Outcome(True, 0.4)  # no recipe run
    text = lm_map.map_tables(outcomes, {0: 0.3})
    assert "| 8 | 5/5 alive, val 0.400, 5 learned |" in text
    assert "| 8 | 0/5 alive, val 0.000, 0 learned |" in text
    assert f"| stable | gae | 8 | 0.0002 | 5/5 | 0/5 | {2 / 252:.3g} |" in text
    # every candidate is tested against the recipe where both ran: 4/5 vs 0/5 is p = 10/210
    assert f"| stable_rho | gae | 8 | 0.0002 | 4/5 | 0/5 | {10 / 210:.3g} |" in text
    assert "| stable_rho | gae | 16 |" not in text
    assert "| stable | gae | 8 | 0.0002 | 5 | -0.120" in text


def test_the_candidate_overlay_is_labelled_and_sets_what_the_docs_say():
    text = (ROOT / "configs" / "async_stable.yaml").read_text()
    # Labelled with how little of the map has run, until the screen covers it.
    assert text.startswith("# Overlay: the first candidate of issue 30's lag x lr map")
    assert "SCREENED AT TWO CELLS ONLY" in text
    model = yaml.safe_load(text)["model"]
    assert model["skip_equal_reward_batches"] is True
    assert model["actor_objective"]["init_args"]["weight_cap"] == 2.0
    assert model["actor_step_size"]["class_path"].endswith("ESSAdaptiveStepSize")
    rho = yaml.safe_load((ROOT / "configs" / "targets" / "rho_in_advantage.yaml").read_text())
    assert rho["model"]["value_target"] == {"init_args": {"rho_in_advantage": True, "rho_bar": 1.2}}
    assert lm_map.CONFIGURATIONS["stable_rho"] == (
        ROOT / "configs" / "async_stable.yaml",
        ROOT / "configs" / "targets" / "rho_in_advantage.yaml",
    )


def test_map_commands_differ_only_in_lr_lag_and_overlays(tmp_path: Path):
    recipe = ROOT / "configs" / "evidence" / "long_count.yaml"
    kw = dict(steps=200, every=20, recipe=recipe, extra=[])
    base = lm_map.map_command(MapCell("recipe", "gae", 8, 5e-5, 1, 2), tmp_path, **kw)
    stable = lm_map.map_command(MapCell("stable", "gae", 8, 5e-5, 1, 2), tmp_path, **kw)
    assert "--model.actor_optimizer.init_args.lr=5e-05" in base
    assert "--data.init_args.lag=8" in base and "--seed_everything=2" in base
    assert str(tmp_path / "warm1" / "warm_start" / "actor") in " ".join(base)
    base = [a for a in base if "save_dir=" not in a]
    stable = [a for a in stable if "save_dir=" not in a]
    at = base.index(str(ROOT / "configs" / "targets" / "gae.yaml")) + 1
    overlay = ["--config", str(ROOT / "configs" / "async_stable.yaml")]
    assert stable == base[:at] + overlay + base[at:]


@pytest.mark.slow
def test_a_two_cell_map_runs_resumes_and_writes_its_table_and_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    recipe = tiny_recipe(tmp_path / "tiny.yaml")
    out = tmp_path / "map"
    fake_warm_start(lm_map.warm_folder(out, 0))
    argv = ["--out", str(out), "--config", str(recipe), "--configs", "recipe", "--targets", "gae"]
    argv += ["--lags", "0", "1", "--lrs", "1e-4", "--seeds", "0", "--warm-seeds", "0"]
    argv += ["--steps", "3", "--every", "3", "--collapse-window", "3", "--collapse-count", "2"]
    argv += ["--val-window", "1"]
    lm_map.main(argv)
    printed = capsys.readouterr().out
    assert "warm start 0: validation done" in printed
    cells = [MapCell("recipe", "gae", lag, 1e-4, 0, 0) for lag in (0, 1)]
    for cell in cells:
        assert f"{cell}: done" in printed
    assert not math.isnan(lm_map.warm_validation(out, 0))
    outcomes = json.loads((out / "outcomes.json").read_text())
    assert sorted(o["lag"] for o in outcomes) == [0, 1]
    table = (out / "map.md").read_text()
    assert "**recipe, gae**" in table and ("1/1 alive" in table or "0/1 alive" in table)
    assert (out / "map.png").stat().st_size > 0
    lm_map.main(argv)  # rerun: every run has its marker
    printed = capsys.readouterr().out
    assert "warm start 0: validation skipped" in printed
    assert all(f"{cell}: skipped" in printed for cell in cells)
    # Each finished run left a record (OUT/records by default) with the series the map reads.
    records = out / "records"
    for cell in cells:
        record = json.loads(lm_map.record_file(records, cell).read_text())
        assert record["cell"] == cell.__dict__
        assert set(record["series"]) >= {"rollout/reward", "val/reward", "kl/mu_pi_k3"}
    assert (records / "warm0.json").exists()
    # On a machine without the runs' folders the records are the map: nothing runs (no warm
    # start either), and the table is the same.
    moved = tmp_path / "records"
    records.rename(moved)
    lm_map.main([*argv[:1], str(tmp_path / "elsewhere"), *argv[2:], "--records", str(moved)])
    printed = capsys.readouterr().out
    assert all(f"{cell}: recorded" in printed for cell in cells)
    assert "warm start" not in printed
    assert (tmp_path / "elsewhere" / "map.md").read_text() == table
    assert not (tmp_path / "elsewhere" / "cells").exists()


def test_stable_budget_cells_within_its_budget_are_stable_rhos_runs(tmp_path: Path):
    """Its staleness factor is exactly 1 while S · lr ≤ the overlay's budget (8e-4), so those
    cells read (and run) stable_rho's folder; beyond the budget they are runs of their own."""
    budget = yaml.safe_load((ROOT / "configs" / "staleness_step_size.yaml").read_text())
    assert lm_map.SAME_RUNS["stable_budget"] == (
        "stable_rho",
        budget["model"]["actor_step_size"]["init_args"]["lr_budget"],
    )
    for lag, lr in [(0, 2e-4), (4, 2e-4), (8, 1e-4), (16, 5e-5), (16, 2.5e-5)]:
        cell = MapCell("stable_budget", "gae", lag, lr, 1, 2)
        assert cell.same_run() == MapCell("stable_rho", "gae", lag, lr, 1, 2)
        assert cell.folder(tmp_path) == cell.same_run().folder(tmp_path)
    for lag, lr in [(8, 2e-4), (16, 1e-4), (4, 2.5e-4)]:
        cell = MapCell("stable_budget", "gae", lag, lr, 0, 0)
        assert cell.same_run() == cell
        assert "stable_budget" in str(cell.folder(tmp_path))
    for config in ("recipe", "stable", "stable_rho"):
        assert MapCell(config, "brace", 16, 5e-5, 0, 0).same_run().config == config


def test_the_half_budget_candidate_is_stable_budget_with_lr_budget_4e_4(tmp_path: Path):
    """The fourth candidate runs stable_budget's overlays with one override, lr_budget 4e-4: its
    cells with S · lr ≤ 4e-4 are stable_rho's runs, stable_budget's cell at S = 8, lr 1e-4 (8e-4,
    within the overlay's budget) is not, and its commands carry the override after the overlays."""
    config = "stable_budget_4e-4"
    assert lm_map.CONFIGURATIONS[config] == lm_map.CONFIGURATIONS["stable_budget"]
    assert lm_map.SAME_RUNS[config] == ("stable_rho", 4e-4)
    for lag, lr in [(8, 5e-5), (16, 2.5e-5), (4, 1e-4), (0, 2e-4)]:
        assert MapCell(config, "gae", lag, lr, 0, 0).same_run().config == "stable_rho"
    for lag, lr in [(8, 1e-4), (8, 2e-4), (16, 5e-5)]:
        assert MapCell(config, "gae", lag, lr, 0, 0).same_run().config == config
    override = "--model.actor_step_size.init_args.lr_budget=0.0004"
    recipe = ROOT / "configs" / "quickstart.yaml"
    cell = MapCell(config, "gae", 8, 2e-4, 0, 0)
    command = lm_map.map_command(cell, tmp_path, steps=4, every=2, recipe=recipe, extra=["--x=1"])
    assert command.index(override) < command.index("--x=1")
    assert str(ROOT / "configs" / "staleness_step_size.yaml") in command
    budget = MapCell("stable_budget", "gae", 8, 2e-4, 0, 0)
    plain = lm_map.map_command(budget, tmp_path, steps=4, every=2, recipe=recipe, extra=[])
    assert override not in plain


def test_the_warning_table_replays_the_default_collapse_warning_on_each_run():
    """first_warnings gives the step of a run's first warning per signal (the callback's rule on
    its logged series), and the table counts collapsed runs and survivors it would have warned
    on, per configuration."""
    from brace_lightning.callbacks import CollapseWarning

    watch = CollapseWarning(patience=3)
    kl = [(step, 0.05 if step >= 10 else 0.0) for step in range(1, 21)]
    series = {"kl/mu_pi_k3": kl, "rollout/length_capped_fraction": [(1, 1.0), (2, 1.0)]}
    first = lm_map.first_warnings(series, watch)
    assert first == {
        "kl_threshold": 12,
        "length_cap_threshold": None,
        "equal_reward_threshold": None,
    }
    down, alive, quiet = (MapCell("recipe", "gae", 8, 2e-4, 0, s) for s in range(3))
    outcomes = {down: Outcome(False, 0.0), alive: Outcome(True, 0.4), quiet: Outcome(True, 0.5)}
    warnings = {down: first, alive: first, quiet: dict.fromkeys(first)}
    text = lm_map.warning_table(outcomes, warnings, watch)
    assert "| recipe | 1 | 2 | 1/1, median step 12; survivors 1/2 | 0/1; survivors 0/2 |" in text
    assert "kl/mu_pi_k3 > 0.02" in text and "patience 3" in text


def test_a_run_that_differs_from_its_record_is_reported_and_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    """The record keeps RECORDED_TAGS only; a run under OUT that disagrees with its record (a
    rerun that did not reproduce) is named, and its own series is what the map reads."""
    cell = MapCell("recipe", "gae", 8, 2e-4, 0, 0)
    out, records = tmp_path / "out", tmp_path / "records"
    folder = cell.folder(out)
    folder.mkdir(parents=True)
    (folder / "done.json").write_text(json.dumps({"seconds": 12.5}))
    series = {
        "rollout/reward": [(1, 0.5), (2, 0.25)],
        "val/reward": [(2, 0.5)],
        "other": [(1, 1.0)],
    }
    monkeypatch.setattr(lm_map, "read_series", lambda path: series)
    assert lm_map.run_series(cell, out, records) == series
    record = json.loads(lm_map.record_file(records, cell).read_text())
    assert record["seconds"] == 12.5 and set(record["series"]) == {"rollout/reward", "val/reward"}
    assert "differs" not in capsys.readouterr().out
    series = {**series, "rollout/reward": [(1, 0.5), (2, 0.0)]}
    lm_map._load_record.cache_clear()
    assert lm_map.run_series(cell, out, records) == series
    assert f"{cell}: the run in {out} differs from its record" in capsys.readouterr().out
    (folder / "done.json").unlink()
    assert lm_map.run_series(cell, out, records) == {
        "rollout/reward": [(1, 0.5), (2, 0.25)],
        "val/reward": [(2, 0.5)],
    }
    assert lm_map.run_series(MapCell("recipe", "gae", 4, 2e-4, 0, 0), out, records) is None


def test_a_recorded_warm_start_is_used_instead_of_training_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Another CPU does not rebuild the same warm-started actor from the same seed, so the
    records pin it: one trained here is recorded, a recorded one is copied in (not trained), and
    an out folder holding a different one is refused in one sentence."""
    trained: list[Path] = []
    monkeypatch.setattr(lm_map, "warm_start", lambda folder, recipe, extra: trained.append(folder))
    monkeypatch.setattr(lm_map, "run_marked", lambda folder, args, record: "done")
    records = tmp_path / "records"
    here = tmp_path / "here"
    fake_warm_start(lm_map.warm_folder(here, 0))
    lm_map.prepare_warm_start(here, 0, Path("recipe.yaml"), [], records)
    weights = "actor/model.safetensors"
    kept = records / "warm0" / weights
    assert kept.read_bytes() == (lm_map.warm_folder(here, 0) / "warm_start" / weights).read_bytes()
    assert lm_map.warm_sha256(here, 0) == hashlib.sha256(kept.read_bytes()).hexdigest()
    elsewhere = tmp_path / "elsewhere"
    lm_map.prepare_warm_start(elsewhere, 0, Path("recipe.yaml"), [], records)
    assert lm_map.warm_sha256(elsewhere, 0) == lm_map.warm_sha256(here, 0)
    other = tmp_path / "other"
    fake_warm_start(lm_map.warm_folder(other, 0))
    path = lm_map.warm_folder(other, 0) / "warm_start" / weights
    tensors = safetensors.torch.load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1.0  # other weights
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(SystemExit, match="warm start 0 in .* is not the one recorded in"):
        lm_map.prepare_warm_start(other, 0, Path("recipe.yaml"), [], records)
    assert len(trained) == 2  # warm_start itself skips an actor that is there


def test_the_runs_table_gives_each_runs_outcomes_and_its_last_window():
    """One row per run: collapsed, final validation, learned with its margin over the run's own
    warm start, and over the last window the zero-reward batches, mean k3 KL and mean lr factor
    (1 without a step-size rule), and the steps the equal-reward rule skipped."""
    stale = MapCell("stable_budget_4e-4", "gae", 8, 2e-4, 0, 1)
    fresh = MapCell("stable_budget_4e-4", "gae", 0, 2e-4, 1, 0)
    outcomes = {stale: Outcome(True, 0.5), fresh: Outcome(False, 0.25)}
    series = {
        stale: {
            "rollout/reward": [(s, 0.0 if s in (1, 4) else 0.5) for s in range(1, 6)],
            "kl/mu_pi_k3": [(1, 9.0), (4, 0.01), (5, 0.03)],
            "lr/actor_scale": [(4, 0.25), (5, 0.26)],
            "actor/skipped_equal_reward": [(1, 1.0), (4, 1.0), (5, 0.0)],
        },
        fresh: {"rollout/reward": [(1, 0.0)], "kl/mu_pi_k3": [(1, -1e-7)]},
    }
    table = lm_map.runs_table(outcomes, series, {0: 0.3125, 1: 0.5}, window=2)
    rows = [line for line in table.splitlines() if line.startswith("| stable")]
    assert rows == [
        "| stable_budget_4e-4 | gae | 0 | 0.0002 | 1 | 0 | yes | 0.250 | no (-0.250) | 1 | 0.000 | 1 | 0 |",
        "| stable_budget_4e-4 | gae | 8 | 0.0002 | 0 | 1 | no | 0.500 | yes (+0.188) | 1 | 0.020 "
        "| 0.26 | 2 |",
    ]


def _screen(lags: tuple[int, ...], lrs: tuple[float, ...]) -> list[MapCell]:
    return lm_map.map_grid(["recipe"], ["gae"], lags, lrs, [0], [0, 1])


def test_the_boundary_rule_finds_splits_and_the_last_survivors_before_a_collapse():
    """Declared with the screen (docs/stability.md): a cell is on the boundary when its screen
    runs split, or when both survived and the next cell up along S or along lr had both collapse;
    a cell whose decision needs a run not there yet is reported as undecided."""
    lags, lrs = (0, 4, 8), (5e-5, 1e-4)
    screen = _screen(lags, lrs)
    alive = {  # (lag, lr) -> survival of seeds 0 and 1
        (0, 5e-5): (True, True),  # the next up along S survived: not boundary
        (0, 1e-4): (True, True),  # the next up along S collapsed: boundary
        (4, 5e-5): (True, True),  # the next up along lr (4, 1e-4) collapsed: boundary
        (4, 1e-4): (False, False),  # collapsed: never boundary
        (8, 5e-5): (True, False),  # split
        (8, 1e-4): (False, None),  # seed 1 missing: undecided
    }
    outcomes = {}
    for cell in screen:
        survived = alive[(cell.lag, cell.lr)][cell.seed]
        if survived is not None:
            outcomes[cell] = Outcome(survived, 0.5 if survived else 0.0)
    boundary, undecided = lm_map.boundary_cells(outcomes, screen)
    assert boundary == {
        ("recipe", "gae", 0, 1e-4): "the next S up (S = 4, lr 0.0001) collapsed",
        ("recipe", "gae", 4, 5e-5): "the next lr up (S = 4, lr 0.0001) collapsed",
        ("recipe", "gae", 8, 5e-5): "split (1/2 survived)",
    }
    assert undecided == [("recipe", "gae", 8, 1e-4)]
    text = lm_map.boundary_table(boundary, undecided)
    assert "| recipe | gae | 8 | 5e-05 | split (1/2 survived) |" in text
    assert text.endswith("cells not decided yet (a screen run they need is missing): recipe/gae: 1")
    # A survivor whose only collapsed-or-not neighbour is missing cannot be decided yet; at the
    # grid's top corner (no neighbour up) a survivor is not on the boundary.
    del outcomes[MapCell("recipe", "gae", 4, 1e-4, 0, 1)]
    boundary, undecided = lm_map.boundary_cells(outcomes, screen)
    assert ("recipe", "gae", 4, 5e-5) in undecided and ("recipe", "gae", 0, 1e-4) in undecided
    corner = _screen((0,), (5e-5,))
    assert lm_map.boundary_cells({c: Outcome(True, 0.5) for c in corner}, corner) == ({}, [])


def test_boundary_cells_get_five_runs_from_two_warm_starts_in_run_order():
    cells = lm_map.boundary_grid([("recipe", "gae", 8, 5e-5), ("recipe", "brace", 4, 1e-4)])
    assert [(c.warm, c.seed) for c in cells[::2]] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert [c.target for c in cells[:2]] == ["brace", "gae"]
    assert len(set(cells)) == 10


def test_the_boundary_option_reads_the_screen_and_lists_what_the_boundary_still_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    """``--boundary --aggregate-only`` on records: the screen's outcomes decide the boundary,
    whose added runs (not recorded yet) are listed as missing; nothing runs."""
    records = tmp_path / "records"
    for cell in _screen((0, 4), (5e-5,)):
        rewards = [(s, 0.0 if cell.lag == 4 and cell.seed == 1 else 0.5) for s in range(1, 41)]
        series = {"rollout/reward": rewards, "val/reward": [(40, 0.5)]}
        payload = {"cell": cell.__dict__, "series": series}
        path = lm_map.record_file(records, cell)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload))
    argv = ["--out", str(tmp_path / "out"), "--records", str(records), "--configs", "recipe"]
    argv += ["--targets", "gae", "--lags", "0", "4", "--lrs", "5e-5", "--boundary"]
    lm_map.main([*argv, "--aggregate-only"])
    printed = capsys.readouterr().out
    assert "| recipe | gae | 4 | 5e-05 | split (1/2 survived) |" in printed
    missing = printed.split("missing cells (3): ")[1].strip().split(", ")
    assert missing == [
        f"recipe/gae/lag4/lr5e-05/warm{w}/seed{s}" for w, s in ((0, 2), (1, 0), (1, 1))
    ]
    assert not (tmp_path / "out" / "cells").exists()
    sections = (tmp_path / "out" / "map.md").read_text().split("\n\n**")
    assert sections[-1].startswith("CPU time of the runs read")  # the docs call it the last table


def test_the_cost_table_sums_each_run_once_from_its_marker_or_record(tmp_path: Path):
    """How the CPU hours were spent: a run under OUT counts its marker's seconds, a recorded one
    its record's; a cell that is another configuration's run (SAME_RUNS) is that run, counted once."""
    out, records = tmp_path / "out", tmp_path / "records"
    here = MapCell("recipe", "gae", 4, 5e-5, 0, 0)
    here.folder(out).mkdir(parents=True)
    (here.folder(out) / "done.json").write_text(json.dumps({"seconds": 600.0}))
    shared = MapCell("stable_rho", "gae", 4, 5e-5, 0, 0)
    for cell, seconds in ((shared, 1200.0), (MapCell("stable_rho", "gae", 8, 5e-5, 0, 0), 1800.0)):
        path = lm_map.record_file(records, cell)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cell": cell.__dict__, "seconds": seconds, "series": {}}))
    cells = [here, shared, MapCell("stable_budget_4e-4", "gae", 4, 5e-5, 0, 0)]  # S·lr 2e-4: shared
    cells += [MapCell("recipe", "gae", 16, 5e-5, 0, 0)]  # not run: not counted
    assert lm_map.run_seconds(cells[-1], out, records) is None
    table = lm_map.cost_table(cells, out, records)
    assert table.endswith(
        "`stable_rho`'s runs here are also the cells of stable_budget_4e-4 "
        "that train bit for bit as them (SAME_RUNS); each is counted once."
    )
    unrun = MapCell("stable_budget_4e-4", "gae", 4, 2.5e-5, 0, 0)  # stable_rho's, not run
    assert "SAME_RUNS" not in lm_map.cost_table([unrun], out, records)  # no row, no line on it
    rows = [line for line in table.splitlines() if "| " in line]
    assert rows[1:] == [
        "| recipe | gae | 1 | 0.2 | 10.0 |",
        "| stable_rho | gae | 1 | 0.3 | 20.0 |",
        "| all |  | 2 | 0.5 | 15.0 |",
    ]
