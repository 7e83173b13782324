"""Skipping rollout batches that have nothing to train on.

A batch can lose every sample before the trainer sees it: a verifier that is down (every reward
raising or NaN), a flaky one on a tiny batch, rows too stale after a resume with a smaller
``max_staleness``. Such a batch is not a reason to stop the run, so both data modules skip it (no
training step, no new policy version), count it in ``count/empty_batches`` and fetch the next one.
Only ``max_consecutive_empty_batches`` empty batches in a row stop the run, with one sentence that
gives the counts, because then nothing is ever going to be trained on. In the async module a
skipped batch frees an admission slot as a trained one does, so the staleness bound still holds (a
later batch may then be fewer than S versions behind with a fixed ``lag``).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping

from brace_lightning.checks import require_int
from brace_lightning.rollout.types import RolloutBatch

logger = logging.getLogger(__name__)


class EmptyBatchGuard:
    """Counts empty rollout batches and raises after ``limit`` of them in a row.

    Args:
        limit: ``max_consecutive_empty_batches``, an integer >= 1.
    """

    def __init__(self, limit: int) -> None:
        require_int("max_consecutive_empty_batches", limit, 1)
        self.limit = limit
        self.consecutive = 0

    def skip(self, batch: RolloutBatch, counters: MutableMapping[str, int]) -> bool:
        """Whether ``batch`` has no action token to train on (then ``counters["empty_batches"]``
        goes up by one).

        Raises:
            RuntimeError: on the ``limit``-th empty batch in a row.
        """
        if len(batch) and batch.num_actions:
            self.consecutive = 0
            return False
        self.consecutive += 1
        counters["empty_batches"] = counters.get("empty_batches", 0) + 1
        counts = ", ".join(f"{k}={v}" for k, v in counters.items())
        if self.consecutive >= self.limit:
            raise RuntimeError(
                f"{self.consecutive} rollout batches in a row had no sample to train on (counts "
                f"so far: {counts}); check that the verifier (reward or env) is up and returns "
                "finite rewards, the task and max_staleness, or raise "
                f"max_consecutive_empty_batches={self.limit}."
            )
        logger.warning("Skipping a rollout batch with no sample to train on (%s).", counts)
        return True
