"""Run names that say what differs between runs of one recipe.

Every overlay of the quickstart (another value target, objective, staleness or task) would log to
``runs/quickstart/version_N``, where runs cannot be told apart. The CLI appends
:func:`run_name` (``<task>-<target>-<objective>-<staleness>``, e.g.
``ArithmeticTask-GAE-PPOClip-lag0``) to the TensorBoard logger's ``name``, so the run lands in
``runs/quickstart/ArithmeticTask-GAE-PPOClip-lag0/version_N``.

``--trainer.default_root_dir DIR`` moves a recipe's relative log folder (``save_dir: runs``) and
checkpoint folder under ``DIR`` (:func:`place_under_root_dir`). A resumed run logs on in its
checkpoint's folder rather than opening ``version_N+1``
(:func:`resume_in_run_folder`), and ``--ckpt_path last`` finds the newest ``last.ckpt`` of the
recipe's runs there.
"""

from __future__ import annotations

import re
from pathlib import Path
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


def _tensorboard_name(config: Any) -> str | None:
    """The name :func:`name_tensorboard_run` gives the run, or None when it names none: the logger
    is not one TensorBoardLogger given by class path with a name and no explicit version."""
    logger = config.get("trainer.logger")
    if logger is None or isinstance(logger, (bool, list)):
        return None
    if _class_name(config, "trainer.logger") != "TensorBoardLogger":
        return None
    name = config.get("trainer.logger.init_args.name")
    if not name or config.get("trainer.logger.init_args.version") is not None:
        return None
    suffix = run_name(config)
    return f"{name}/{suffix}" if suffix else name


def name_tensorboard_run(config: Any) -> None:
    """Append :func:`run_name` to ``trainer.logger``'s ``name`` when the logger is one
    TensorBoardLogger given by class path with a name and no explicit version (in place)."""
    name = _tensorboard_name(config)
    if name is not None:
        config["trainer.logger.init_args.name"] = name


#: Lightning's names of the ``save_last`` file (``last.ckpt``, ``last-v1.ckpt``, ...).
LAST = re.compile(r"last(-v\d+)?")


def resume_in_run_folder(config: Any) -> None:
    """With a ``ckpt_path``, keep logging in the checkpoint's run folder (in place).

    The runs of a recipe live in ``<save_dir>/<name>/version_N`` with their checkpoints in
    ``version_N/checkpoints`` (Lightning's layout; ``<name>`` as :func:`name_tensorboard_run` gives
    it). ``ckpt_path: last`` becomes the newest ``last.ckpt`` there (unchanged when there is none:
    Lightning then looks in the new run's folder), and a checkpoint inside ``version_N/checkpoints``
    sets the logger's version to ``version_N``, so a resumed (or already finished) run does not
    open ``version_N+1``. Nothing changes without a TensorBoard run name (see above).
    """
    ckpt_path = config.get("ckpt_path")
    name = _tensorboard_name(config)
    if not ckpt_path or name is None:
        return
    run_dir = Path(config.get("trainer.logger.init_args.save_dir") or ".") / name
    if ckpt_path == "last":
        found = [p for p in run_dir.glob("version_*/checkpoints/*.ckpt") if LAST.fullmatch(p.stem)]
        if not found:
            return
        ckpt_path = str(max(found, key=lambda path: path.stat().st_mtime))
        config["ckpt_path"] = ckpt_path
    folder = Path(ckpt_path).resolve().parent
    if (
        folder.name == "checkpoints"
        and folder.parent.name.startswith("version_")
        and folder.parent.parent == run_dir.resolve()
    ):
        config["trainer.logger.init_args.name"] = name  # the version now fixes the folder
        config["trainer.logger.init_args.version"] = folder.parent.name


def place_under_root_dir(config: Any) -> None:
    """Put the TensorBoard logger's relative ``save_dir`` and the run checkpoint's relative
    ``dirpath`` under ``trainer.default_root_dir`` when one is given (in place); absolute folders
    stay where they are. Lightning itself uses ``default_root_dir`` only where a logger or a
    checkpoint names no folder, so a recipe's ``save_dir: runs`` would not move."""
    root = config.get("trainer.default_root_dir")
    if not root:
        return
    keys = ["checkpoint.dirpath"]
    if _class_name(config, "trainer.logger") == "TensorBoardLogger":
        keys.append("trainer.logger.init_args.save_dir")
    for key in keys:
        folder = config.get(key)
        if isinstance(folder, str) and not Path(folder).is_absolute():
            config[key] = str(Path(root) / folder)
