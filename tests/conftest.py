"""Test-suite settings: one torch thread per process, no hub access, no run seed carried over.

The tests run on 2-core machines that are often busy; torch's default of one thread per core then
slows small ops by orders of magnitude (oversubscription). One thread is also what the benchmark
tables assume, and it keeps float reductions in the same order on every machine. Nothing may be
downloaded at test time, so the Hugging Face hub is switched off (a missing model fails at once).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402

from brace_lightning.seeds import GLOBAL_SEED_ENV  # noqa: E402


@pytest.fixture(autouse=True)
def _no_run_seed_from_an_earlier_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without a run seed: a CLI run in an earlier test sets ``PL_GLOBAL_SEED``
    (``seed_everything``), which components left at ``seed=None`` would otherwise follow."""
    monkeypatch.delenv(GLOBAL_SEED_ENV, raising=False)
