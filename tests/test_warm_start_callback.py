"""SupervisedWarmStart: runs in ``setup`` on the plain modules, copies the actor's backbone into
the critic in place, and skips (one info line) when the task has no supervised pairs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from brace_lightning.callbacks import SupervisedWarmStart
from brace_lightning.models.critic import critic_seed
from brace_lightning.module import BraceModule
from brace_lightning.tasks import ArithmeticTask
from brace_lightning.warmstart import copy_backbone_to_critic


def _module() -> BraceModule:
    return BraceModule(tiny_hidden_size=32, tiny_num_layers=1, seed=0)


def _trainer(task: object, ckpt_path: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        datamodule=SimpleNamespace(task=task),
        ckpt_path=ckpt_path,
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        is_global_zero=True,
        progress_bar_callback=None,
        logger=None,
    )


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_copy_backbone_to_critic_copies_in_place_and_reseeds_the_head() -> None:
    module = _module()
    critic_params = [p.data_ptr() for p in module.critic.parameters()]
    with torch.no_grad():
        for p in module.actor.parameters():
            p.add_(0.5)  # the critic must now differ from the actor until the copy
    copy_backbone_to_critic(module.actor, module.critic, seed=7)
    actor_base = module.actor.base_model.state_dict()
    for name, value in module.critic.backbone.state_dict().items():
        torch.testing.assert_close(value, actor_base[name], rtol=0, atol=0)
        assert value.data_ptr() != actor_base[name].data_ptr()  # own storage
    assert [p.data_ptr() for p in module.critic.parameters()] == critic_params  # in place
    head = module.critic.value_head
    assert torch.all(head.bias == 0) and 0 < head.weight.std() < 1e-2
    first = head.weight.clone()
    copy_backbone_to_critic(module.actor, module.critic, seed=7)
    torch.testing.assert_close(head.weight, first, rtol=0, atol=0)  # seeded
    with pytest.raises(ValueError, match="base_model"):
        copy_backbone_to_critic(torch.nn.Linear(2, 2), module.critic, seed=0)


def test_warm_start_trains_the_actor_and_seeds_the_critic_in_setup() -> None:
    module = _module()
    before = _weights(module.actor)
    callback = SupervisedWarmStart(num_pairs=16, steps=3, batch_size=4)
    callback.setup(_trainer(ArithmeticTask(num_operands=2, max_value=9)), module, "fit")
    assert callback.done and callback.final_loss is not None
    after = module.actor.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in module.actor.parameters())  # nothing left for DDP/RL
    actor_base = module.actor.base_model.state_dict()
    for name, value in module.critic.backbone.state_dict().items():
        assert torch.equal(value, actor_base[name])
    head = module.critic.value_head.weight
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(critic_seed(callback.seed))  # the critic's seed, not the pairs' seed
        expected = torch.empty_like(head).normal_(0.0, 1e-3)
    assert torch.equal(head, expected)
    # Runs once: a second setup (or one on resume, or for validate) leaves the weights alone.
    trained = _weights(module.actor)
    callback.setup(_trainer(ArithmeticTask()), module, "fit")
    fresh = SupervisedWarmStart(num_pairs=16, steps=3, batch_size=4)
    fresh.setup(_trainer(ArithmeticTask(), ckpt_path="last.ckpt"), module, "fit")
    fresh.setup(_trainer(ArithmeticTask()), module, "validate")
    assert not fresh.done
    assert all(torch.equal(trained[k], v) for k, v in module.actor.state_dict().items())


def test_warm_start_is_skipped_with_one_sentence_without_supervised_pairs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    module = _module()
    before = _weights(module.actor)
    callback = SupervisedWarmStart(num_pairs=16, steps=3, batch_size=4)
    with caplog.at_level(logging.INFO):
        callback.setup(_trainer(object()), module, "fit")
    assert callback.done and callback.final_loss is None
    messages = [r.getMessage() for r in caplog.records if "Warm start" in r.getMessage()]
    assert messages == ["Warm start skipped: the task (object) has no supervised_pairs(n)."]
    assert all(torch.equal(before[k], v) for k, v in module.actor.state_dict().items())
