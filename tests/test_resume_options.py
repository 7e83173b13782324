"""On resume, a model option given explicitly that differs from the checkpoint's saved value is
refused in one sentence (exit 2); the same value, or the option left out, resumes.

Before, LightningCLI copied the checkpoint's hyperparameters over the parsed options:
``fit --ckpt_path CKPT --model.value_target GAE`` on a BRACE checkpoint trained BRACE, and a changed
model size was ignored.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from brace_lightning.cli import run
from brace_lightning.targets import BRACE
from tests.test_trainer import CONFIGS, small_run

#: One rollout step of 4 optimizer steps (2 minibatches, actor and critic), then a checkpoint.
COMMON = ["--model.ppo_epochs=1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BRACE checkpoint (configs/quickstart.yaml) saved after rollout step 1."""
    tmp_path = tmp_path_factory.mktemp("first")
    save = [
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.max_steps=1",
    ]
    first = run(small_run(tmp_path, *COMMON, *save, steps=2))
    assert first.model.rollout_step == 1
    (path,) = (tmp_path / "ckpt").iterdir()
    return path


@pytest.mark.parametrize(
    ("option", "given", "saved"),
    [
        (
            ["--model.value_target=GAE"],
            "brace_lightning.targets.GAE",
            "brace_lightning.targets.BRACE",
        ),
        (["--config", str(CONFIGS / "targets" / "gae.yaml")], None, None),
        (["--model.value_target.init_args.k=20"], "20", "100"),
        (["--model.tiny_hidden_size=32"], "32", "64"),
        (["--model.ppo_epochs=2"], "2", "1"),
    ],
    ids=["value_target", "config_file", "target_argument", "model_size", "ppo_epochs"],
)
def test_an_explicit_option_that_differs_from_the_checkpoint_is_refused(
    tmp_path, capsys, checkpoint, option, given, saved
):
    args = small_run(tmp_path, *COMMON, f"--ckpt_path={checkpoint}", *option, steps=2)
    with pytest.raises(SystemExit) as info:
        run(args)
    err = capsys.readouterr().err
    assert info.value.code == 2
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert last.endswith(
        f"saved in ckpt_path={str(checkpoint)!r}: resume with the checkpoint's value or start a "
        "new run."
    ), last
    name = option[0].split("=")[0] if given is not None else "--model.value_target"
    if given is None:  # a --config file: the value target it names
        given, saved = "brace_lightning.targets.GAE", "brace_lightning.targets.BRACE"
    assert last.startswith(f"error: {name}={given} differs from the value {saved} "), last


@pytest.mark.parametrize(
    "option", [[], ["--model.value_target=BRACE"]], ids=["same_recipe", "same_value"]
)
def test_the_checkpoints_value_resumes(tmp_path, checkpoint, option):
    args = small_run(tmp_path, *COMMON, f"--ckpt_path={checkpoint}", *option, steps=2)
    resumed = run(args)
    assert resumed.model.rollout_step == 2
    assert isinstance(resumed.model.value_target, BRACE)
    assert resumed.model.value_target.k == 100


def test_an_option_left_out_takes_the_checkpoints_value(tmp_path, checkpoint):
    args = small_run(tmp_path, *COMMON, f"--ckpt_path={checkpoint}", steps=2)
    args.remove("--model.tiny_hidden_size=64")  # the default is another size
    resumed = run(args)
    assert resumed.model.rollout_step == 2
    assert resumed.model.hparams.tiny_hidden_size == 64
    assert resumed.model.actor.config.hidden_size == 64
