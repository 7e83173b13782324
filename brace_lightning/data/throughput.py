"""Token throughput of a data module's hand-outs, the same in the sync and the async module.

Between two ``next_batch`` calls the trainer trains on the batch it was handed, so

* ``train_tokens_per_s`` = action tokens of the previous batch / the time from handing it out to
  the next request (the trainer's own speed: forward passes, value target, update, weight sync);
* ``tokens_per_s`` = action tokens of the previous batch / the time from handing it out to handing
  out the next one (end to end: in the sync module generation is on that path, in the async module
  only the wait for a batch the producer has not finished).

Both are absent on the first batch, which has no previous one.
"""

from __future__ import annotations

import time


class TokenThroughput:
    """Tokens per second of the batches a data module hands out."""

    def __init__(self) -> None:
        self._handed_out_at: float | None = None
        self._tokens = 0

    def reset(self) -> None:
        """Forget the previous batch (a restart: the time since then is start-up, not training)."""
        self._handed_out_at = None
        self._tokens = 0

    def hand_out(self, requested_at: float, tokens: int) -> dict[str, float]:
        """Record a batch of ``tokens`` action tokens handed out now, requested at monotonic time
        ``requested_at``; returns the rates of the previous batch (empty for the first)."""
        now = time.monotonic()
        rates: dict[str, float] = {}
        if self._handed_out_at is not None:
            train = max(requested_at - self._handed_out_at, 1e-9)
            rates["train_tokens_per_s"] = self._tokens / train
            rates["tokens_per_s"] = self._tokens / max(now - self._handed_out_at, 1e-9)
        self._handed_out_at = now
        self._tokens = tokens
        return rates
