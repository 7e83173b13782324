"""Read the scalars a run wrote to TensorBoard (for notebooks, benchmarks and tests)."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series of the TensorBoard event files under ``log_dir``: name → [(step, value)].

    Args:
        log_dir: a run folder holding ``events.out.tfevents.*`` (e.g.
            ``runs/quickstart/ArithmeticTask-BRACE-PPOClip-lag0/version_0``).
    """
    path = Path(log_dir)
    if not any(path.glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"log_dir {str(path)!r} holds no TensorBoard event files.")
    accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }
