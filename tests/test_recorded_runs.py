"""The recorded runs (``tests/support/recorded_runs.py``) reproduce bit for bit: every deterministic metric
of every rollout step and the SHA-256 of the final actor and critic weights, against the recording of
this machine's kind of CPU; on a kind without one, every metric within a tolerance of each recording.

A refactor must leave them unchanged; a change meant to alter training re-records them
(``python -m tests.support.recorded_runs --record``) and says why in its commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.recorded_runs import (
    RECORDINGS,
    RUNS,
    close_to,
    cpu_kind,
    expected_path,
    run,
)


def recordings() -> dict[str, dict]:
    """Every kind of CPU's recording, by kind."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(RECORDINGS.glob("*.json"))}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_recorded_run_is_bit_identical(name: str, tmp_path: Path) -> None:
    got = run(name, tmp_path)
    path = expected_path()
    if not path.exists():  # another CPU: each recording within the tolerance, weights not compared
        for kind, recorded in recordings().items():
            for step, (have, want) in enumerate(
                zip(got["steps"], recorded[name]["steps"], strict=True)
            ):
                assert sorted(have) == sorted(want), f"{name} step {step}: other metrics"
                assert not close_to(have, want), (
                    f"{name} step {step} vs {kind}: {close_to(have, want)}"
                )
        return
    expected = json.loads(path.read_text())[name]
    assert len(got["steps"]) == len(expected["steps"])
    for step, (have, want) in enumerate(zip(got["steps"], expected["steps"], strict=True)):
        assert sorted(have) == sorted(want), f"{name} step {step}: other metrics"
        changed = {k: (have[k], want[k]) for k in want if have[k] != want[k] and want[k] == want[k]}
        assert not changed, f"{name} step {step}: (got, recorded on {path.stem}) {changed}"
    assert got["weights_sha256"] == expected["weights_sha256"]


def test_cpu_kinds_name_the_vendor_and_the_widest_vector_unit() -> None:
    amd = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse4_2 avx avx2 fma\n"
    intel = "vendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f avx512bw\n"
    assert cpu_kind(amd) == "AuthenticAMD-avx2"
    assert cpu_kind(intel) == "GenuineIntel-avx512"
    assert cpu_kind("vendor_id\t: GenuineIntel\nflags\t\t: fpu sse2\n") == "GenuineIntel-baseline"
    assert expected_path("AuthenticAMD-avx2").is_file()


def test_the_tolerance_of_an_unrecorded_cpu_catches_a_changed_run() -> None:
    """The kinds' recordings lie within the tolerance of each other (so one held to them passes),
    and a metric moved by more than it fails."""
    amd, intel = (recordings()[k] for k in ("AuthenticAMD-avx2", "GenuineIntel-avx512"))
    for name in RUNS:
        for have, want in zip(intel[name]["steps"], amd[name]["steps"], strict=True):
            assert not close_to(have, want), name
    step = dict(amd["quickstart"]["steps"][-1])
    step["critic/loss"] += 1e-4 + 2e-3 * abs(step["critic/loss"])  # just past the tolerance
    assert list(close_to(step, amd["quickstart"]["steps"][-1])) == ["critic/loss"]


def test_recorded_runs_cover_the_paths_the_refactor_moves() -> None:
    """The recordings hold what they are meant to pin: a KL term, EWMA, a lagged engine, the
    producer's counts and two trained networks per run."""
    kinds = recordings()
    assert len(kinds) >= 2 and all(sorted(recorded) == sorted(RUNS) for recorded in kinds.values())
    recorded = kinds["AuthenticAMD-avx2"]
    last = {name: record["steps"][-1] for name, record in recorded.items()}
    assert "actor/kl_ref_loss" in last["padded_lag_ewma_kl"]
    assert "time/ewma_forward_ms" not in last["padded_lag_ewma_kl"]  # filtered: a clock
    assert last["padded_lag_ewma_kl"]["data/staleness_max"] == 1.0
    assert "kl/ref_penalty" in last["vtrace_kl_reward"]
    assert last["async_fixed"]["data/staleness_max"] == 1.0
    for name, record in recorded.items():
        assert len(record["steps"]) == 4, name
        assert record["steps"][-1]["policy_version"] == 3.0, name  # one critic warm-up step
