"""Batched rewards and RewardModel: one call per rollout batch, errors dropped and counted per
sample, a tiny sequence-classification model scored as its own forward says, pickled as its
arguments only, and the reward-model overlay in the sync and async (producer process) recipes."""

from __future__ import annotations

import math
import pickle
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from brace_lightning.cli import run
from brace_lightning.critic_reward import CriticReward
from brace_lightning.export import save_hf_folders
from brace_lightning.logs import read_scalars
from brace_lightning.models import load_tokenizer
from brace_lightning.models.critic import ValueModel
from brace_lightning.models.sources import load_actor
from brace_lightning.rollout.collect import score_and_pad
from brace_lightning.rollout.engine import GenerationOutput
from brace_lightning.tasks import BatchedReward, Prompt, RewardModel
from examples.tiny_reward_model import write_tiny_reward_model
from tests.test_trainer import small_run

TOKENIZER = load_tokenizer("tiny-char")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PROMPTS = [Prompt(text="1+1=", answer="2"), Prompt(text="Name a colour:", answer="")]


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rm") / "tiny_reward_model"
    write_tiny_reward_model(str(out))
    return out


def generated(texts: Sequence[str]) -> GenerationOutput:
    """Every text answers prompt i % 2, as a one-token-per-character response."""
    ids = [TOKENIZER(text)["input_ids"] for text in texts]
    return GenerationOutput(
        prompt_ids=[TOKENIZER(PROMPTS[i % 2].text)["input_ids"] for i in range(len(texts))],
        response_ids=ids,
        logprobs=[[0.0] * len(r) for r in ids],
        versions=[[0] * len(r) for r in ids],
        prompt_index=[i % 2 for i in range(len(texts))],
        finish_reason=["stop"] * len(texts),
    )


class LengthScores(BatchedReward):
    """Scores len(completion) − 2 (NaN for "nan", raises for "boom"), counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def score_batch(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list[float]:
        self.calls += 1
        if "boom" in completions:
            raise RuntimeError("reward server down")
        return [math.nan if c == "nan" else float(len(c) - 2) for c in completions]


def test_a_batched_reward_scores_the_batch_in_one_call_and_drops_bad_scores_one_by_one() -> None:
    reward = LengthScores()
    batch = score_and_pad(generated(["a", "abc", "nan", "abcd"]), PROMPTS, TOKENIZER, reward, 0, 0)
    assert reward.calls == 1
    assert batch.scores.tolist() == [-1.0, 1.0, 2.0]  # "nan" dropped
    assert batch.correct.tolist() == [False, True, True]  # correct(score): score > 0
    assert batch.info["dropped_reward_error"] == 1.0 and batch.info["generated"] == 4.0
    assert batch.group_ids.tolist() == [0, 1, 1]


def test_a_batched_reward_that_raises_drops_its_batch_and_counts_every_sample() -> None:
    batch = score_and_pad(generated(["a", "boom"]), PROMPTS, TOKENIZER, LengthScores(), 0, 0)
    assert len(batch) == 0 and batch.info["dropped_reward_error"] == 2.0


def test_a_batched_reward_with_the_wrong_number_of_scores_drops_the_batch() -> None:
    class Short(LengthScores):
        def score_batch(self, prompts, completions):
            return [1.0]

    batch = score_and_pad(generated(["a", "b", "c"]), PROMPTS, TOKENIZER, Short(), 0, 0)
    assert len(batch) == 0 and batch.info["dropped_reward_error"] == 3.0


def test_a_hung_batched_reward_stops_the_run_within_its_per_sample_deadline() -> None:
    release = threading.Event()

    class Hangs(LengthScores):
        def score_batch(self, prompts, completions):
            release.wait()
            return [0.0] * len(completions)

    try:
        with pytest.raises(RuntimeError, match="every one of the 2 samples .* timed out"):
            score_and_pad(
                generated(["a", "b"]), PROMPTS, TOKENIZER, Hangs(), 0, 0, reward_timeout=0.1
            )
    finally:
        release.set()


def test_reward_model_scores_are_its_forward_on_each_pair_alone(tiny_rm: Path) -> None:
    completions = ["2", "red and a much longer answer", "", "blue"]
    prompts = [PROMPTS[i % 2] for i in range(4)]
    chunked = RewardModel(str(tiny_rm), batch_size=3).score_batch(prompts, completions)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_rm)
    alone = []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = tokenizer(prompt.text + completion, return_tensors="pt")
        with torch.no_grad():
            alone.append(float(model(**ids).logits[0, 0]))
    assert chunked == pytest.approx(alone, abs=1e-5)
    assert len(set(alone)) == 4  # the pairs do get different rewards
    reward = RewardModel(str(tiny_rm), threshold=alone[0])
    assert reward(prompts[0], completions[0]) == pytest.approx(alone[0], abs=1e-5)
    assert reward.is_correct(prompts[1], completions[1]) == (alone[1] > alone[0])


def test_max_length_keeps_the_last_tokens_and_template_changes_the_text(tiny_rm: Path) -> None:
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_rm)

    def forward(text: str) -> float:
        with torch.no_grad():
            return float(model(**tokenizer(text, return_tensors="pt")).logits[0, 0])

    prompt = Prompt(text="Name a colour:", answer="")
    cut = RewardModel(str(tiny_rm), max_length=3).score_batch([prompt], ["red"])
    assert cut == pytest.approx([forward("red")], abs=1e-5)  # the last 3 characters
    templated = RewardModel(str(tiny_rm), template="Q: {prompt}\nA: {completion}")
    assert templated(prompt, "red") == pytest.approx(forward("Q: Name a colour:\nA: red"), abs=1e-5)


def test_reward_model_pickles_as_its_arguments_and_reloads(tiny_rm: Path) -> None:
    reward = RewardModel(str(tiny_rm), max_length=8)
    before = reward.score_batch(PROMPTS, ["x", "y"])
    data = pickle.dumps(reward)
    assert len(data) < 2000  # no weights travel to a producer process
    again = pickle.loads(data)
    assert again._model is None and again.score_batch(PROMPTS, ["x", "y"]) == pytest.approx(before)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "RewardModel got batch_size=0; expected an integer >= 1"),
        ({"max_length": True}, "RewardModel got max_length=True"),
        ({"label": -1}, "RewardModel got label=-1; expected an integer >= 0"),
        ({"template": "{prompt}"}, "expected a '{prompt}' and a '{completion}' field"),
        ({"device": "gpu:x"}, "gpu:x"),
    ],
)
def test_reward_model_arguments_are_checked(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, RuntimeError), match=match):
        RewardModel("anywhere", **kwargs)


def test_a_label_beyond_the_head_is_refused_in_one_sentence(tiny_rm: Path) -> None:
    with pytest.raises(
        ValueError, match="label=1; expected an index below the model's num_labels=1"
    ):
        RewardModel(str(tiny_rm), label=1).score_batch(PROMPTS[:1], ["x"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe", [[], ["--config", str(CONFIGS / "async.yaml")]], ids=["sync", "async"]
)
def test_the_reward_model_overlay_trains_in_sync_and_async_mode(
    recipe: list[str], tiny_rm: Path, tmp_path: Path
) -> None:
    args = small_run(tmp_path)  # its --trainer.callbacks=[] comes after the overlays: no checkpoint
    args[3:3] = [*recipe, "--config", str(CONFIGS / "tasks" / "reward_model.yaml")]
    args += [
        f"--data.task.init_args.path={EXAMPLES / 'reward_model_prompts.jsonl'}",
        f"--data.reward.init_args.model={tiny_rm}",
    ]
    cli = run(args)
    assert type(cli.datamodule.reward).__name__ == "RewardModel"
    scalars = read_scalars(cli.trainer.logger.log_dir)
    rewards = [value for _, value in scalars["rollout/reward"]]
    assert len(rewards) == 2 and all(math.isfinite(r) and r != 0.0 for r in rewards)
    assert [v for _, v in scalars["data/count/dropped_reward_error"]] == [0.0, 0.0]


def test_an_exported_critic_scores_the_value_of_each_whole_pair(tmp_path: Path) -> None:
    tokenizer = load_tokenizer("tiny-char")
    actor = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=32, num_layers=1, seed=0)
    torch.manual_seed(0)
    critic = ValueModel(actor.base_model, head_init_std=0.5).eval()
    save_hf_folders(actor, critic, tokenizer, tmp_path / "exported")
    # no spaces: the character tokenizer saved and read back by AutoTokenizer drops them
    completions = ["2", "a-longer-answer", "blue"]
    prompts = [Prompt(text="1+1=", answer="2"), Prompt(text="Colour:", answer="")] * 2
    reward = CriticReward(str(tmp_path / "exported" / "critic"), batch_size=2)
    got = reward.score_batch(prompts[:3], completions)
    alone = []
    for prompt, completion in zip(prompts[:3], completions, strict=True):
        ids = torch.tensor([tokenizer(prompt.text + completion)["input_ids"]])
        with torch.no_grad():
            alone.append(float(critic(ids, torch.ones_like(ids))[0, -1]))
    assert got == pytest.approx(alone, abs=1e-5) and len(set(alone)) == 3
    with pytest.raises(ValueError, match="has no value_head.safetensors"):
        CriticReward(str(tmp_path / "exported" / "actor")).score_batch(prompts[:1], ["x"])
