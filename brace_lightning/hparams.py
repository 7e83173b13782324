"""The module's component objects as ``class_path`` + ``init_args`` configs, and back.

``BraceModule`` saves its hyperparameters so that ``load_from_checkpoint`` rebuilds the same run.
The value target, actor objective and critic loss are small config objects (their ``__init__``
arguments are stored as attributes of the same names), so they are saved as the dictionaries
LightningCLI writes for them (``{"class_path": "brace_lightning.targets.GAE", "init_args":
{...}}``): plain data, readable in ``hparams.yaml`` and loadable with ``weights_only=True``. A
module built by LightningCLI already receives its hyperparameters in this form; one built in
Python gets them converted by :func:`to_config`, and :func:`from_config` turns them back into
objects when the checkpoint is loaded. At the end of ``fit`` :func:`log_final_hparams` fills
TensorBoard's HParams tab with the final metrics. :func:`check_module_arguments` validates the
module's own arguments (one sentence per mistake).
"""

from __future__ import annotations

import inspect
import math
import sys
from typing import Any, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from brace_lightning.checks import require_bool, require_int
from brace_lightning.models.lora import LoraSettings
from brace_lightning.models.parallelize import mixed_precision_dtypes
from brace_lightning.models.weight_sync import bucket_bytes_from_mb
from brace_lightning.objectives.aggregation import check_mode
from brace_lightning.objectives.functional import KL_ESTIMATORS

T = TypeVar("T")


def to_config(obj: object) -> dict[str, Any]:
    """``{"class_path": "<module>.<Class>", "init_args": {name: value}}`` of a config object.

    ``init_args`` reads, for every keyword of ``type(obj).__init__``, the attribute of that name
    (a nested config object of this package as its own config).
    """
    cls = type(obj)
    init_args = {}
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if not hasattr(obj, name):
            raise ValueError(
                f"to_config got a {cls.__name__} without attribute {name!r}; expected every "
                "__init__ argument stored under its own name."
            )
        init_args[name] = _plain(getattr(obj, name))
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}


def _plain(value: Any) -> Any:
    """A config object of this package inside a component (an ``ess`` rule inside a step-size
    rule) as its own config; any other value as it is."""
    if type(value).__module__.startswith("brace_lightning.") and not isinstance(
        value, int | float | str | tuple | list | dict
    ):
        return to_config(value)
    return value


#: The module's arguments saved as class_path + init_args configs (or, for ``lora``, a dict).
COMPONENTS = ("value_target", "actor_objective", "critic_loss", "actor_step_size", "lora")


def save_component_configs(module: pl.LightningModule, names: tuple[str, ...]) -> None:
    """Save the component objects among ``module``'s hyperparameters ``names`` as the configs
    LightningCLI writes (one built by LightningCLI already holds dicts); ``LoraSettings`` (a
    dataclass, which LightningCLI instantiates) as the dictionary of its fields; None stays."""
    objects = {}
    for name in names:
        value = module.hparams[name]
        if isinstance(value, LoraSettings):
            objects[name] = value.to_dict()
        elif not isinstance(value, dict | None):  # built in Python, not by LightningCLI
            objects[name] = to_config(value)
    if objects:
        module.save_hyperparameters(objects)


def from_config(value: T | dict[str, Any], base: type[T], argument: str) -> T:
    """``value`` itself if it is a ``base``, else the object its ``class_path`` config describes.

    A jsonargparse ``lazy_instance`` (the signature's defaults) is built for real, so that
    ``save_hyperparameters`` can copy it (a lazy instance cannot be deep-copied).
    """
    lazy_type = getattr(value, "_lazy_class_type", None)
    if isinstance(lazy_type, type) and issubclass(lazy_type, base):
        return lazy_type(**getattr(value, "_lazy_kwargs", {}))
    if isinstance(value, base):
        return value
    if not (isinstance(value, dict) and isinstance(value.get("class_path"), str)):
        raise ValueError(
            f"{argument} must be a {base.__module__}.{base.__name__} or a "
            f"{{'class_path': ..., 'init_args': ...}} config of one; got {value!r}."
        )
    module_name, _, class_name = value["class_path"].rpartition(".")
    # Only already imported classes: a checkpoint's config must not import (run) new code.
    cls = getattr(sys.modules.get(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(
            f"{argument} has class_path {value['class_path']!r}; expected an already imported "
            f"subclass of {base.__module__}.{base.__name__}."
        )
    return cls(**value.get("init_args", {}))


#: Prefixes of the logged metrics whose last values go to TensorBoard's HParams tab.
FINAL_METRIC_PREFIXES = ("rollout/", "val/")


def log_final_hparams(module: pl.LightningModule) -> None:
    """Write the hyperparameters with the run's final metrics to TensorBoard's HParams tab.

    The last logged value of every ``rollout/*`` and ``val/*`` metric is written as ``hp/<name>``
    (slashes become underscores) at the last rollout step, so runs can be compared by their
    hyperparameters. Only for a :class:`TensorBoardLogger`, on rank 0.
    """
    trainer = module.trainer
    if not isinstance(trainer.logger, TensorBoardLogger) or not trainer.is_global_zero:
        return
    metrics = {
        "hp/" + name.replace("/", "_"): float(value)
        for name, value in trainer.callback_metrics.items()
        if name.startswith(FINAL_METRIC_PREFIXES)
    }
    if metrics:
        trainer.logger.log_hyperparams(
            module.hparams_initial, metrics, step=int(getattr(module, "rollout_step", 0))
        )


#: Where the KL to the reference policy goes: a term of the actor loss or a reward penalty.
KL_MODES = ("loss", "reward")


def check_ewma_support(
    ewma_decay: float | None, *, fsdp_meta_init: bool = False, fsdp: bool = False
) -> None:
    """PPO-EWMA keeps a full unsharded copy of the actor: refused with FSDP2 and its meta init."""
    if ewma_decay is None:
        return
    if fsdp_meta_init:
        raise ValueError(
            "actor_objective.ewma_decay is not supported with fsdp_meta_init=True (the EWMA "
            "actor is a full copy of the actor); set one of them off."
        )
    if fsdp:
        raise ValueError(
            "actor_objective.ewma_decay is not supported with ModelParallelStrategy "
            "(FSDP2): the EWMA actor is a full copy of the actor; use strategy 'ddp' or "
            "ewma_decay=None."
        )


def check_module_arguments(args: dict[str, Any]) -> None:
    """One ValueError sentence for the first bad argument of ``BraceModule`` (``args``: its
    ``__init__``'s arguments by name)."""
    for name, low in (("ppo_epochs", 1), ("num_minibatches", 1), ("critic_warmup_steps", 0)):
        require_int(name, args[name], low)
    for name in ("micro_batch_size", "max_tokens_per_micro_batch"):
        value = args[name]
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or an integer >= 1; got {value!r}.")
    max_grad_norm = args["max_grad_norm"]
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be None or > 0; got {max_grad_norm!r}.")
    require_bool("pack_sequences", args["pack_sequences"])
    require_bool("log_version_drift", args["log_version_drift"])
    kl_coef = args["kl_coef"]
    if isinstance(kl_coef, bool) or not (
        isinstance(kl_coef, int | float) and 0.0 <= kl_coef < math.inf
    ):
        raise ValueError(f"kl_coef must be a finite number >= 0; got {kl_coef!r}.")
    if args["kl_estimator"] not in KL_ESTIMATORS:
        raise ValueError(
            f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {args['kl_estimator']!r}."
        )
    if args["kl_mode"] not in KL_MODES:
        raise ValueError(f"kl_mode must be one of {', '.join(KL_MODES)}; got {args['kl_mode']!r}.")
    bucket_bytes_from_mb(args["weight_sync_bucket_mb"])  # validates the setting
    check_mode(args["loss_aggregation"], args["loss_max_len"])
    mixed_precision_dtypes(args["fsdp_mixed_precision"], "cpu")  # validates the setting
