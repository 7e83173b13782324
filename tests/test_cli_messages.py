"""The CLI's messages keep their cause and say what to type: a missing package's install hint,
"did you mean" for a typo, the module's own options for LightningCLI's optimizer options and the
trainer options it replaces, ``export`` in ``--help`` (``cli_errors.py``, ``cli.py``); a reward
that raises shows its traceback once with a count (``console.ErrorsOnce``); an unknown model name
offline fails at once (``models/sources.py``)."""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Iterator

import huggingface_hub.constants
import pytest

from brace_lightning.cli import run
from brace_lightning.cli_errors import construction_sentence, unknown_option_sentence
from brace_lightning.console import ErrorsOnce
from brace_lightning.models import sources
from brace_lightning.rollout.collect import score_and_pad
from brace_lightning.tasks.base import Prompt, RewardFunction
from tests.test_reward_timeout import TOKENIZER, generated
from tests.test_trainer import CONFIGS

QUICKSTART = ["fit", "--config", str(CONFIGS / "quickstart.yaml")]


def _error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last line printed by a CLI call that must exit with code 2."""
    with pytest.raises(SystemExit) as stop:
        run(args)
    captured = capsys.readouterr()
    assert stop.value.code == 2, captured
    return (captured.out + captured.err).strip().splitlines()[-1]


def test_a_missing_package_keeps_its_install_hint(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed: no import error to report")
    except ImportError:
        pass
    line = _error([*QUICKSTART, "--trainer.logger", "WandbLogger"], capsys)
    assert line.startswith("error: Problem with given class_path") and "WandbLogger" in line
    assert "pip install" in line and "wandb" in line.split("WandbLogger", 1)[1]


def test_the_cause_of_a_class_error_follows_its_first_line() -> None:
    try:
        try:
            raise ImportError(
                "HFPrompts needs the `datasets` package: pip install -e '.[datasets]'"
            )
        except ImportError as cause:
            raise ValueError("Problem with given class_path 'x.HFPrompts':\n  details") from cause
    except ValueError as error:
        sentence = construction_sentence(error)
    assert sentence == (
        "Problem with given class_path 'x.HFPrompts': "
        "HFPrompts needs the `datasets` package: pip install -e '.[datasets]'"
    )
    assert construction_sentence(ValueError("k must be > 0;\n dump")) == "k must be > 0;"


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("--trainer.acumulate_grad_batches", "--trainer.accumulate_grad_batches"),
        ("--model.ppo_epohcs", "--model.ppo_epochs"),
        ("--data.prompts_per_stp", "--data.prompts_per_step"),
    ],
)
def test_an_unknown_option_gets_did_you_mean(
    typo: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error([*QUICKSTART, typo, "2"], capsys)
    assert f"did you mean {meant} (not {typo})?" in line


def test_no_guess_for_an_option_like_none_known() -> None:
    message = "unrecognized arguments: --zzz 1"
    assert unknown_option_sentence(message, ["--model.ppo_epochs"]) == message


@pytest.mark.parametrize(
    ("given", "pointer"),
    [
        (["--optimizer", "Adam"], "--model.actor_optimizer and --model.critic_optimizer"),
        (["--lr_scheduler", "StepLR"], "--model.actor_scheduler and --model.critic_scheduler"),
        (["--trainer.accumulate_grad_batches", "2"], "--model.num_minibatches"),
        (["--trainer.gradient_clip_val", "1.0"], "--model.max_grad_norm"),
    ],
)
def test_optimization_options_point_at_the_modules_own(
    given: list[str], pointer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error([*QUICKSTART, *given], capsys)
    assert line.startswith("error: ") and given[0] in line and pointer in line


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_validate_without_val_batches_says_what_to_set(
    subcommand: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [subcommand, "--config", str(CONFIGS / "quickstart.yaml")]
    line = _error(args, capsys)
    assert line.startswith(
        f"error: {subcommand} scores on-policy rollouts but --data.val_batches is 0"
    )
    assert "set --data.val_batches N" in line


def test_help_names_export(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run(["--help"])
    out = capsys.readouterr().out
    assert "brace-lightning export --ckpt_path" in " ".join(out.split())


class ShortAnswersFail(RewardFunction):
    """Raises the same error on completions shorter than 3 characters, scores the others 1."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        if len(completion) < 3:
            raise RuntimeError("verifier crashed")
        return 1.0


def test_a_failing_reward_is_shown_once_with_its_traceback_and_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ErrorsOnce, "shown", set())
    prompts = [Prompt(text="q", answer="1")]
    with caplog.at_level(logging.DEBUG, logger="brace_lightning.rollout.collect"):
        for _ in range(3):  # three rollout batches of 5 samples, 2 of them failing
            batch = score_and_pad(generated(5), prompts, TOKENIZER, ShortAnswersFail(), 0, 0)
            assert batch.info["dropped_reward_error"] == 2.0 and len(batch) == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    (shown,) = warnings
    assert shown.getMessage().startswith(
        "reward ShortAnswersFail raised RuntimeError: verifier crashed on 2 of 5 samples"
    )
    assert "data/count/dropped_reward_error" in shown.getMessage()
    assert shown.exc_info is not None
    assert 'raise RuntimeError("verifier crashed")' in "".join(
        traceback.format_exception(*shown.exc_info)
    )
    assert (
        sum(r.levelno == logging.DEBUG and "again" in r.getMessage() for r in caplog.records) == 2
    )


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process that finds the hub unreachable (its switch to HF_HUB_OFFLINE undone after)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda endpoint: False)
    sources.use_cache_when_offline.cache_clear()
    yield
    sources.use_cache_when_offline.cache_clear()


def test_an_unknown_model_name_offline_fails_at_once_in_one_sentence(offline: None) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^tokenizer source 'no-such-org/no-such-model' is") as e:
        sources.load_tokenizer("no-such-org/no-such-model")
    assert time.monotonic() - start < 10.0  # without the switch: about a minute of retries
    assert "the hub is not reachable (offline)" in str(e.value) and "\n" not in str(e.value)
    assert huggingface_hub.constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"


def test_the_hub_check_is_one_short_connection() -> None:
    start = time.monotonic()
    assert not sources.hub_reachable("https://127.0.0.1:9", timeout=1.0)  # discard port: refused
    assert time.monotonic() - start < 5.0
