"""One seed per run: a component's ``seed=None`` follows Lightning's ``seed_everything``.

The model, the data module, the task, the engine and the warm start each take a ``seed``. Left at
None, each uses the run's seed: the value last given to ``seed_everything`` (the recipes'
``seed_everything: 0``, or ``--seed_everything N`` on the command line; Lightning keeps it in the
``PL_GLOBAL_SEED`` environment variable, which spawned producer processes inherit), or 0 when no
seed was set. So ``brace-lightning fit ... --seed_everything 3`` changes the model's initialisation,
the prompts, the sampling and the minibatch order together; a component given its own seed keeps it.
"""

from __future__ import annotations

import os

#: Where ``lightning.seed_everything`` keeps the run's seed.
GLOBAL_SEED_ENV = "PL_GLOBAL_SEED"


def run_seed(seed: int | None = None) -> int:
    """``seed`` itself, or the run's seed when None (``seed_everything``'s value, else 0)."""
    if seed is not None:
        return int(seed)
    return int(os.environ.get(GLOBAL_SEED_ENV, "0"))
