"""One seed per run: a component's ``seed=None`` follows Lightning's ``seed_everything``.

The model, the data module, the task, the engine and the warm start each take a ``seed``. Left at
None, each uses the run's seed: the value last given to ``seed_everything`` (the recipes'
``seed_everything: 0``, or ``--seed_everything N`` on the command line; Lightning keeps it in the
``PL_GLOBAL_SEED`` environment variable, which spawned producer processes inherit), or 0 when no
seed was set. So ``brace-lightning fit ... --seed_everything 3`` changes the model's initialisation,
the prompts, the sampling and the minibatch order together; a component given its own seed keeps it.
:func:`rng_state` and :func:`restore_rng_state` carry the global random states through checkpoints.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

#: Where ``lightning.seed_everything`` keeps the run's seed.
GLOBAL_SEED_ENV = "PL_GLOBAL_SEED"


def run_seed(seed: int | None = None) -> int:
    """``seed`` itself, or the run's seed when None (``seed_everything``'s value, else 0)."""
    if seed is not None:
        return int(seed)
    return int(os.environ.get(GLOBAL_SEED_ENV, "0"))


def rng_state() -> dict[str, Any]:
    """The global torch, Python and NumPy random states, as plain types (a checkpoint holding them
    loads with ``torch.load(weights_only=True)``)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": (str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the global random states saved by :func:`rng_state`."""
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    name, keys, pos, has_gauss, cached = state["numpy_rng"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
