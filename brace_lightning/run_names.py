"""Run names that say what differs between runs of one recipe.

Every overlay of the quickstart (another value target, objective, staleness or task) would log to
``runs/quickstart/version_N``, where runs cannot be told apart. The CLI appends
:func:`run_name` (``<task>-<target>-<objective>-<staleness>``, e.g.
``ArithmeticTask-GAE-PPOClip-lag0``) to the TensorBoard logger's ``name``, so the run lands in
``runs/quickstart/ArithmeticTask-GAE-PPOClip-lag0/version_N``.
"""

from __future__ import annotations

from typing import Any


def _class_name(config: Any, key: str) -> str | None:
    class_path = config.get(f"{key}.class_path") if config.get(key) is not None else None
    return class_path.rpartition(".")[2] if isinstance(class_path, str) else None


def run_name(config: Any) -> str:
    """``<task>-<target>-<objective>-<staleness>`` from a parsed ``fit``/``validate`` config
    (a jsonargparse Namespace); parts that the config does not name are left out.

    Staleness is ``lag<N>`` for the synchronous data module and ``stale<=N>`` for the
    asynchronous one (``max_staleness``).
    """
    parts = [
        _class_name(config, "data.init_args.task"),
        _class_name(config, "model.value_target"),
        _class_name(config, "model.actor_objective"),
    ]
    lag = config.get("data.init_args.lag")
    max_staleness = config.get("data.init_args.max_staleness")
    if _class_name(config, "data") == "AsyncRolloutDataModule" and max_staleness is not None:
        parts.append(f"stale{max_staleness}")
    elif lag is not None:
        parts.append(f"lag{lag}")
    return "-".join(part for part in parts if part)


def name_tensorboard_run(config: Any) -> None:
    """Append :func:`run_name` to ``trainer.logger``'s ``name`` when the logger is one
    TensorBoardLogger given by class path with a name and no explicit version (in place)."""
    logger = config.get("trainer.logger")
    if logger is None or isinstance(logger, (bool, list)):
        return
    if _class_name(config, "trainer.logger") != "TensorBoardLogger":
        return
    name = config.get("trainer.logger.init_args.name")
    if not name or config.get("trainer.logger.init_args.version") is not None:
        return
    suffix = run_name(config)
    if suffix:
        config["trainer.logger.init_args.name"] = f"{name}/{suffix}"
