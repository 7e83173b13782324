"""``brace-lightning``: the LightningCLI entry point (``fit``, ``validate``, ``test``, ``--print_config``,
``--version``).

brace-lightning fit --config configs/quickstart.yaml
brace-lightning fit --config configs/quickstart.yaml --config configs/targets/gae.yaml
brace-lightning fit --config configs/quickstart.yaml --model.value_target.init_args.k 20
brace-lightning fit --config configs/quickstart.yaml --config configs/async.yaml
brace-lightning export --ckpt_path runs/.../checkpoints/last.ckpt --out exported  # HF folders

``data`` is any data module given by ``class_path`` + ``init_args`` in the recipe, or by short name
(``--data RolloutDataModule``, ``--data AsyncRolloutDataModule``; ``--data.help RolloutDataModule``
lists its arguments), and ``--data.max_staleness 4`` style overrides still work.

Resume (``fit --ckpt_path CKPT``) builds the model from the checkpoint's saved hyperparameters. A
model option given explicitly, on the command line or in a ``--config`` file, whose value differs
from the checkpoint's is refused in one sentence (exit 2) naming the option, the given value and the
checkpoint's, rather than silently replaced by the checkpoint's: resume with the checkpoint's value
(or leave the option out) or start a new run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

import brace_lightning
from brace_lightning.callbacks import RunCheckpoint
from brace_lightning.checkpoints import check_ckpt_path
from brace_lightning.cli_errors import (
    check_config_files,
    check_engine_factory,
    config_paths,
    construction_errors,
    fail,
    overridden_option,
    refused_trainer_options,
    unknown_option_sentence,
    validation_without_batches,
)
from brace_lightning.console import quiet_lightning, rollout_progress_bar
from brace_lightning.module import BraceModule
from brace_lightning.run_names import (
    name_tensorboard_run,
    place_under_root_dir,
    resume_in_run_folder,
)
from brace_lightning.tasks.base import RECIPE_ROOTS, project_root

#: Shown at the top of ``fit --help`` and ``validate --help``: the data module's own arguments are
#: listed by ``--data.help``, since ``data`` is chosen by class.
DATA_HELP = (
    "The data module is picked by class, short names work: --data RolloutDataModule (fixed lag) "
    "or --data AsyncRolloutDataModule (max_staleness). Its arguments (prompts_per_step, "
    "samples_per_prompt, lag, max_staleness, engine, task, ...) are listed by "
    "--data.help RolloutDataModule and --data.help AsyncRolloutDataModule."
)


def _option_strings(parser: Any) -> list[str]:
    """Every ``--option`` of ``parser`` and of its subcommands' parsers."""
    options = []
    for action in getattr(parser, "_actions", []):
        options += [o for o in action.option_strings if o.startswith("--")]
        for sub in (getattr(action, "_name_parser_map", None) or {}).values():
            options += _option_strings(sub)
    return options


class BraceArgumentParser(LightningArgumentParser):
    """LightningCLI's parser whose ``unrecognized arguments`` error says "did you mean" and
    points ``--optimizer``/``--lr_scheduler`` at the module's options (``cli_errors.py``)."""

    def error(self, message: str, *args: Any, **kwargs: Any) -> Any:
        return super().error(
            unknown_option_sentence(message, _option_strings(self)), *args, **kwargs
        )


#: Option names whose values are secrets: never written to the run's saved ``config.yaml``.
SECRET_OPTIONS = ("api_key",)


def without_secrets(value: Any) -> Any:
    """A copy of ``value`` (a parsed config: Namespaces, dicts, lists) whose options named in
    :data:`SECRET_OPTIONS` are None, at any depth; ``value`` itself is left as it is."""
    if isinstance(value, Namespace | dict):
        copy = value.clone() if isinstance(value, Namespace) else dict(value)
        for key in list(copy.keys()) if isinstance(copy, dict) else list(vars(copy)):
            item = copy[key] if isinstance(copy, dict) else getattr(copy, key)
            item = None if key in SECRET_OPTIONS else without_secrets(item)
            if isinstance(copy, dict):
                copy[key] = item
            else:
                setattr(copy, key, item)
        return copy
    if isinstance(value, list | tuple):
        return type(value)(without_secrets(item) for item in value)
    return value


class SaveConfigWithoutSecrets(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` writer with every ``api_key`` saved as null: the run's
    folder is often shared (TensorBoard, reports) and the vLLM servers' secret must not travel with
    it. A rerun of the saved config reads the key from ``BRACE_VLLM_API_KEY`` instead."""

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        config = self.config
        self.config = without_secrets(config)
        try:
            super().setup(trainer, pl_module, stage)
        finally:
            self.config = config


#: Shown at the top of ``--help``: ``export`` is its own command, not a LightningCLI subcommand.
ROOT_HELP = (
    "Subcommands: fit (train), validate (score a checkpoint's policy on fresh rollouts), and "
    "export: brace-lightning export --ckpt_path CKPT --out DIR writes Hugging Face folders "
    "(brace-lightning export --help)."
)


class BraceCLI(LightningCLI):
    """LightningCLI with the tokenizer of the data module linked to the actor of the model.

    Subcommands are ``fit``, ``validate`` and ``test`` (the module has no predict step); optimizers
    and schedulers are arguments of the model (``--model.actor_optimizer``), so LightningCLI's
    ``--optimizer``/``--lr_scheduler`` are not offered.
    """

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        commands = LightningCLI.subcommands()
        return {name: commands[name] for name in ("fit", "validate", "test")}

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = super().init_parser(**kwargs)
        parser.add_argument(
            "--version", action="version", version=f"brace-lightning {brace_lightning.__version__}"
        )
        return parser

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse; put relative log and checkpoint folders under ``trainer.default_root_dir`` and
        resolve ``--ckpt_path last`` in the run's folders (``run_names.py``); then refuse a
        ``--ckpt_path`` that is not a readable checkpoint (``checkpoints.py``), a trainer option
        the module replaces and a ``validate`` without batches with one sentence each
        (``cli_errors.py``), before LightningCLI reads hyperparameters or builds a model.

        With a ``--ckpt_path``, the ``model.*`` options given explicitly (command line and
        ``--config`` files, without the defaults) are kept for :meth:`_parse_ckpt_path`.
        """
        super().parse_arguments(parser, args)
        self._explicit_model_options: list[str] = []
        subcommand = self.config.get("subcommand")
        if subcommand:
            place_under_root_dir(self.config[subcommand])
            resume_in_run_folder(self.config[subcommand])
            ckpt_path = self.config[subcommand].get("ckpt_path")
            try:
                check_ckpt_path(ckpt_path)
            except ValueError as error:
                fail(parser, str(error))
            refusal = refused_trainer_options(self.config[subcommand])
            refusal = refusal or validation_without_batches(subcommand, self.config[subcommand])
            if refusal is not None:
                fail(parser, refusal)
            if ckpt_path:
                if isinstance(args, dict | Namespace):
                    explicit = parser.parse_object(args, defaults=False)
                else:
                    explicit = parser.parse_args(args, defaults=False)
                keys = explicit[subcommand].keys() if subcommand in explicit else []
                self._explicit_model_options = [k for k in keys if k.startswith("model.")]

    def _parse_ckpt_path(self) -> None:
        """Copy the checkpoint's hyperparameters into the config (LightningCLI), then refuse an
        explicit model option whose value they replaced, in one sentence (exit 2)."""
        given = self.config.clone()
        super()._parse_ckpt_path()
        subcommand = self.config.get("subcommand")
        if not subcommand or not self._explicit_model_options:
            return
        refusal = overridden_option(
            self._explicit_model_options,
            given[subcommand],
            self.config[subcommand],
            self.config[subcommand].get("ckpt_path"),
        )
        if refusal is not None:
            fail(self.parser, refusal)

    def before_instantiate_classes(self) -> None:
        """Name the TensorBoard run by task, target, objective and staleness (``run_names.py``)."""
        name_tensorboard_run(self.config[self.subcommand] if self.subcommand else self.config)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Link the data module's tokenizer to the actor; every run's checkpoint is configured by
        ``--checkpoint.*`` (``callbacks.RunCheckpoint``), apart from ``trainer.callbacks``, so a
        recipe's callbacks list (or ``--trainer.callbacks=[]``) leaves it in place."""
        parser.link_arguments("model.actor", "data.init_args.tokenizer")
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with :func:`~brace_lightning.console.rollout_progress_bar` unless the
        config turns the bar off or brings its own, and the run's checkpoint unless
        ``trainer.enable_checkpointing`` is false."""
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        callbacks = list(config.get("callbacks") or [])
        if config.get("enable_progress_bar") is not False and not any(
            isinstance(callback, ProgressBar) for callback in callbacks
        ):
            config["callbacks"] = callbacks = [*callbacks, rollout_progress_bar()]
        extra = [
            self._get(self.config_init, key) for key in self._parser(self.subcommand).callback_keys
        ]
        if config.get("enable_checkpointing") is False:
            extra = [callback for callback in extra if not isinstance(callback, RunCheckpoint)]
        return self._instantiate_trainer(config, extra)

    def instantiate_classes(self) -> None:
        """Build the objects; a class's ValueError is reported like a parse error (exit 2)."""
        config = (
            self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        )
        with construction_errors(self.parser, config):
            super().instantiate_classes()
            check_engine_factory(getattr(self.datamodule, "engine_factory", None))


def add_recipe_roots(args: Sequence[str]) -> None:
    """Put the project folder of each ``--config`` file (``tasks.base.project_root``) on
    ``sys.path`` after the working directory and in ``tasks.base.RECIPE_ROOTS``, so a recipe's
    class paths (``examples.my_reward.ExactMatch``) and relative data paths work from any folder.
    A spawned rollout producer inherits ``sys.path``."""
    for path in config_paths(args):
        root = project_root(path) if Path(path).is_file() else None
        if root is None or root in RECIPE_ROOTS:
            continue
        RECIPE_ROOTS.append(root)
        if str(root) not in sys.path:
            sys.path.append(str(root))


def run(args: list[str] | None = None, **cli_kwargs: Any) -> BraceCLI:
    """Run the CLI on ``args`` (default ``sys.argv[1:]``) and return it (its trainer, model, data).

    ``cli_kwargs`` go to :class:`LightningCLI` (e.g. ``trainer_defaults={"callbacks": [...]}``).
    """
    check_config_files(sys.argv[1:] if args is None else args)
    add_recipe_roots(sys.argv[1:] if args is None else args)
    quiet_lightning()
    kwargs: dict[str, Any] = {
        "parser_class": BraceArgumentParser,
        "save_config_callback": SaveConfigWithoutSecrets,
        "save_config_kwargs": {"overwrite": True},
        "auto_configure_optimizers": False,
        "parser_kwargs": {
            "description": ROOT_HELP,
            "fit": {"description": f"Train with PPO. {DATA_HELP}"},
            "validate": {"description": f"Score on-policy rollouts. {DATA_HELP}"},
            "test": {
                "description": f"Score on-policy rollouts of the held-out prompts. {DATA_HELP}"
            },
        },
    }
    kwargs.update(cli_kwargs)
    return BraceCLI(BraceModule, LightningDataModule, subclass_mode_data=True, args=args, **kwargs)


def main() -> None:
    """Console-script entry point ``brace-lightning``.

    The working directory goes first on ``sys.path``, as with ``python -m``, so that a recipe can
    name a user's own module there (``--data.reward my_reward.ExactMatch``).
    """
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if sys.argv[1:2] == ["export"]:
        from brace_lightning.export import main as export_main

        export_main(sys.argv[2:])
        return
    run()


if __name__ == "__main__":
    main()
