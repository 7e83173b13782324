"""``brace-lightning``: the LightningCLI entry point (``fit``, ``validate``, ``--print_config``).

brace-lightning fit --config configs/quickstart.yaml
brace-lightning fit --config configs/quickstart.yaml --config configs/targets/gae.yaml
brace-lightning fit --config configs/quickstart.yaml --model.value_target.init_args.k 20
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from brace_lightning.data import RolloutDataModule
from brace_lightning.module import BraceModule


class BraceCLI(LightningCLI):
    """LightningCLI with the tokenizer of the data module linked to the actor of the model."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.actor", "data.tokenizer")


def run(args: list[str] | None = None) -> BraceCLI:
    """Run the CLI on ``args`` (default ``sys.argv[1:]``) and return it (its trainer, model, data)."""
    return BraceCLI(
        BraceModule,
        RolloutDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


def main() -> None:
    """Console-script entry point ``brace-lightning``."""
    run()


if __name__ == "__main__":
    main()
