"""Cost of handing one policy version to a producer process: fresh shared copies vs weight slots.

    python -m benchmarks.weight_handoff [--repeats 5] [--sizes 64x1 256x4 1024x8]

For each tiny Qwen2 size (hidden x layers, on the tiny-char vocabulary), in the training process:

- *fresh copy*: what a version cost before weight slots: a new CPU copy of the state dict, whose
  storages the queue then moved into new shared memory (``share_memory_``) to send them;
- *slot fill*: :meth:`WeightSlots.fill`, a copy into shared-memory tensors allocated once and reused;
- *install*: the producer's side, ``EmbeddedEngine.update_weights`` from a slot (the same either way).

Medians over ``--repeats`` versions after one warm-up; one torch thread. The fresh copy pays for page
faults of new memory (twice: the copy and the shared segment); a slot's pages are already mapped.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._common import median_seconds, model_size, positive_int, table_header, table_row
from brace_lightning.models import load_tokenizer
from brace_lightning.models.sources import load_actor
from brace_lightning.rollout import EmbeddedEngine
from brace_lightning.rollout.workers import WeightSlots


def fresh_shared_copy(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The former hand-off: clone to the CPU, then move every storage into new shared memory."""
    copy = {name: value.detach().to("cpu", copy=True) for name, value in weights.items()}
    for tensor in copy.values():
        tensor.share_memory_()
    return copy


def measure(hidden: int, layers: int, repeats: int) -> str:
    """One table row: the hand-off costs of a ``hidden`` x ``layers`` tiny Qwen2."""
    actor = load_actor(
        "tiny-char", tokenizer=load_tokenizer("tiny-char"), hidden_size=hidden, num_layers=layers
    )
    weights = actor.state_dict()
    mib = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    params = sum(p.numel() for p in actor.parameters())
    slots = WeightSlots(weights, 2, shared=True)
    engine = EmbeddedEngine(actor)

    def fill() -> None:
        slots.release(slots.fill(weights))

    fresh = median_seconds(lambda: fresh_shared_copy(weights), repeats=repeats)
    slot = median_seconds(fill, repeats=repeats)
    install = median_seconds(lambda: engine.update_weights(slots.tensors[0], 1), repeats=repeats)
    cells = [f"{hidden} x {layers}", f"{params / 1e6:.2f} M", f"{mib:.1f}", f"{1e3 * fresh:.1f}"]
    return table_row([*cells, f"{1e3 * slot:.2f}", f"{fresh / slot:.1f}x", f"{1e3 * install:.2f}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument(
        "--sizes", nargs="+", type=model_size, default=[(64, 1), (256, 4), (1024, 8)]
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"\nmedians of {args.repeats} versions, 1 torch thread\n")
    header = ["model (hidden x layers)", "parameters", "MiB", "fresh copy ms", "slot fill ms"]
    print(table_header([*header, "speed-up", "install ms"]))
    for hidden, layers in args.sizes:
        print(measure(hidden, layers, args.repeats))


if __name__ == "__main__":
    main()
