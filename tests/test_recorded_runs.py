"""The recorded runs (``tests/support/recorded_runs.py``) reproduce bit for bit: every deterministic metric
of every rollout step and the SHA-256 of the final actor and critic weights.

A refactor must leave them unchanged; a change meant to alter training re-records them
(``python -m tests.support.recorded_runs --record``) and says why in its commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.recorded_runs import EXPECTED, RUNS, run


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_recorded_run_is_bit_identical(name: str, tmp_path: Path) -> None:
    expected = json.loads(EXPECTED.read_text())[name]
    got = run(name, tmp_path)
    assert len(got["steps"]) == len(expected["steps"])
    for step, (have, want) in enumerate(zip(got["steps"], expected["steps"], strict=True)):
        assert sorted(have) == sorted(want), f"{name} step {step}: other metrics"
        changed = {k: (have[k], want[k]) for k in want if have[k] != want[k] and want[k] == want[k]}
        assert not changed, f"{name} step {step}: (got, recorded) {changed}"
    assert got["weights_sha256"] == expected["weights_sha256"]


def test_recorded_runs_cover_the_paths_the_refactor_moves() -> None:
    """The recordings hold what they are meant to pin: a KL term, EWMA, a lagged engine, the
    producer's counts and two trained networks per run."""
    recorded = json.loads(EXPECTED.read_text())
    assert sorted(recorded) == sorted(RUNS)
    last = {name: record["steps"][-1] for name, record in recorded.items()}
    assert "actor/kl_ref_loss" in last["padded_lag_ewma_kl"]
    assert "time/ewma_forward_ms" not in last["padded_lag_ewma_kl"]  # filtered: a clock
    assert last["padded_lag_ewma_kl"]["data/staleness_max"] == 1.0
    assert "kl/ref_penalty" in last["vtrace_kl_reward"]
    assert last["async_fixed"]["data/staleness_max"] == 1.0
    for name, record in recorded.items():
        assert len(record["steps"]) == 4, name
        assert record["steps"][-1]["policy_version"] == 3.0, name  # one critic warm-up step
