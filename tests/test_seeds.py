"""One seed per run: ``--seed_everything N`` alone reseeds every component left at ``seed=None``
(``brace_lightning/seeds.py``), and a component given its own seed keeps it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from brace_lightning.cli import run
from brace_lightning.rollout import EmbeddedEngine
from brace_lightning.seeds import GLOBAL_SEED_ENV, run_seed
from brace_lightning.tasks import ArithmeticTask
from tests.test_trainer import small_run


def test_run_seed_is_the_given_seed_else_seed_everythings_else_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert run_seed(None) == 0
    assert run_seed(7) == 7
    monkeypatch.setenv(GLOBAL_SEED_ENV, "123")
    assert run_seed(None) == 123
    assert run_seed(7) == 7
    assert ArithmeticTask().seed == 123
    assert ArithmeticTask(seed=5).seed == 5


def built_run(tmp_path: Path, *extra: str, actor: torch.nn.Module | None = None) -> dict:
    """The seeds and fingerprints of a quickstart run built by the CLI (not trained): the actor's
    initial weights, the task's prompt stream, and four samples of its engine on a fixed prompt
    (from ``actor`` when given, so that only the engine's seed differs)."""
    cli = run(small_run(tmp_path, *extra)[1:], run=False)
    model, data = cli.model, cli.datamodule
    # built now, as the data module builds it at the first batch: after the CLI seeded the run
    engine = (data.engine_factory or EmbeddedEngine)(actor or model.actor)
    return {
        "seeds": (model.seed, data.seed, data.task.seed),
        "actor": model.actor,
        "weights": next(model.actor.parameters()).detach().clone(),
        "prompts": [prompt.text for prompt in itertools.islice(iter(data.task), 4)],
        "samples": engine.generate([[1, 2, 3]], num_samples=4).response_ids,
    }


def test_seed_everything_alone_reseeds_the_model_the_prompts_and_the_sampling(tmp_path):
    first = built_run(tmp_path / "a", "--seed_everything=1")  # its engine samples its own actor
    actor = first["actor"]  # ... which the other runs' engines sample too
    again = built_run(tmp_path / "b", "--seed_everything=1", actor=actor)
    other = built_run(tmp_path / "c", "--seed_everything=2", actor=actor)
    assert first["seeds"] == again["seeds"] == (1, 1, 1)
    assert other["seeds"] == (2, 2, 2)
    assert torch.equal(first["weights"], again["weights"])
    assert not torch.equal(first["weights"], other["weights"])
    assert first["prompts"] == again["prompts"] != other["prompts"]
    assert first["samples"] == again["samples"] != other["samples"]


def test_a_component_given_its_own_seed_keeps_it(tmp_path):
    built = built_run(
        tmp_path,
        "--seed_everything=1",
        "--model.seed=5",
        "--data.seed=6",
        "--data.task.init_args.seed=7",
    )
    assert built["seeds"] == (5, 6, 7)
    default = built_run(tmp_path / "default")  # the recipe's seed_everything: 0
    assert default["seeds"] == (0, 0, 0)
