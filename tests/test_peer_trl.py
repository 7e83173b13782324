"""Our GRPO and Dr. GRPO losses and gradients equal TRL 1.16's ``GRPOTrainer`` on the same samples.

TRL's side is TRL's own code, not a transcription: a real ``GRPOTrainer`` over a tiny model whose
generation and reward calls are replaced by the fixed samples and rewards below, so that its
``_generate_and_score_completions`` forms the groups' advantages and pads the batch, and its
``_compute_loss`` gives the loss that is differentiated (with the given old log-probs in its inputs
dict, as after a generation several optimizer steps ago). Our side is what our trainer composes for
the same batch: ``token_logprobs`` of the actor, the ``GRPO`` / ``DrGRPO`` value target over the
rows' prompt groups, ``PPOClip`` and the loss aggregation TRL's ``loss_type`` maps onto
(``objectives/aggregation.py``). Float64 models, so that a 1e-5 tolerance tests the formulas, not
round-off. The prompts all have the same length, so that TRL's left padding moves no position.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from brace_lightning.models.policy import token_logprobs
from brace_lightning.models.sources import load_actor
from brace_lightning.models.tokenizer import build_char_tokenizer
from brace_lightning.objectives import PPOClip
from brace_lightning.objectives.aggregation import aggregate
from brace_lightning.targets import GRPO, DrGRPO

pytestmark = [
    pytest.mark.slow,  # TRL's import and trainer: about 20 s
    pytest.mark.skipif(
        importlib.util.find_spec("trl") is None, reason="trl is not installed (the peers extra)"
    ),
]

PROMPTS = ["3+4=", "7+1=", "2+9="]
GROUP = 4  # samples per prompt (TRL's num_generations)
MAX_NEW = 7  # TRL's max_completion_length and Dr. GRPO's constant normaliser
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
#: Each rollout's reward (a tie inside the first group, one group of equal rewards: zero advantage).
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 0.25, 0.0]

#: Our value target and aggregation for each TRL (loss_type, scale_rewards).
CASES = {
    "GRPO": (GRPO(eps=1e-4), "seq_mean_token_mean", None, "grpo", "group"),
    "DrGRPO": (DrGRPO(), "seq_mean_token_sum", MAX_NEW, "dr_grpo", "none"),
    "GRPO, token mean": (GRPO(eps=1e-4), "token_mean", None, "dapo", "group"),
}


def samples(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and completion ids of ``len(PROMPTS) * GROUP`` rollouts: random characters of
    1 to ``MAX_NEW`` tokens, some ending in eos."""
    generator = torch.Generator().manual_seed(0)
    prompt_ids, completion_ids = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for _ in range(GROUP):
            length = int(torch.randint(1, MAX_NEW + 1, (), generator=generator))
            tokens = torch.randint(3, len(tokenizer), (length,), generator=generator).tolist()
            if length < MAX_NEW and torch.rand((), generator=generator) < 0.5:
                tokens[-1] = tokenizer.eos_token_id
            prompt_ids.append(list(ids))
            completion_ids.append(tokens)
    return prompt_ids, completion_ids


def trl_loss_and_grads(model, tokenizer, tmp_path, loss_type: str, scale_rewards: str, old_shift):
    """TRL's loss on the fixed samples, and the gradients it gives every parameter."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompt_ids, completion_ids = samples(tokenizer)
    config = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=len(completion_ids),
        num_generations=GROUP,
        max_completion_length=MAX_NEW,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        beta=0.0,
        loss_type=loss_type,
        scale_rewards=scale_rewards,
        pad_to_multiple_of=None,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    trainer._generate = lambda prompts: (
        prompt_ids,
        completion_ids,
        None,
        texts,
        None,
        {},
        None,
        None,
    )
    trainer._calculate_rewards = lambda *_: torch.tensor(REWARDS, dtype=torch.float64)[:, None]
    inputs = trainer._generate_and_score_completions(
        [{"prompt": p} for p in PROMPTS for _ in range(GROUP)]
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    with torch.no_grad():
        logprobs, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            inputs["completion_ids"].size(1),
        )
    inputs["old_per_token_logps"] = logprobs + old_shift[:, : logprobs.size(1)]
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
    return loss.detach(), grads, inputs


def our_loss_and_grads(model, inputs, target, mode: str, max_len: int | None, old_shift):
    """Our loss on the same padded batch: rows = prompt + completion, actions = completion."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1).bool()
    prompt_width = inputs["prompt_ids"].size(1)
    mask = torch.zeros_like(attention)
    mask[:, prompt_width:] = inputs["completion_mask"].bool()
    logprobs, _ = token_logprobs(model, input_ids, attention, chunk_size=None)
    old = torch.zeros_like(logprobs)
    old[:, prompt_width:] = (
        logprobs.detach()[:, prompt_width:] + old_shift[:, : mask.size(1) - prompt_width]
    )
    rewards = torch.zeros_like(logprobs)
    last = mask.long().cumsum(dim=1).argmax(dim=1)  # the reward sits on the last action
    rewards[torch.arange(len(rewards)), last] = torch.tensor(REWARDS, dtype=rewards.dtype)
    group_ids = torch.arange(len(PROMPTS)).repeat_interleave(GROUP)
    targets = target(
        rewards=rewards,
        values=torch.zeros_like(rewards),
        target_logprobs=old,
        behavior_logprobs=old,
        mask=mask,
        group_ids=group_ids,
    )
    objective = PPOClip(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    out = objective(
        logprobs=logprobs,
        proximal_logprobs=old,
        behavior_logprobs=old,
        advantages=targets.advantages,
        mask=mask,
    )
    loss = aggregate(out.token_loss, mask, mode, max_len)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, targets.advantages


@pytest.mark.parametrize("case", list(CASES))
def test_our_group_losses_and_gradients_equal_trls_on_the_same_samples(case: str, tmp_path) -> None:
    target, mode, max_len, loss_type, scale_rewards = CASES[case]
    tokenizer = build_char_tokenizer()
    model = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=32, num_layers=1, seed=0)
    model = model.to(torch.float64)
    ours_model = copy.deepcopy(model)
    # Old log-probs off the current ones by up to ±0.4 nats: some ratios leave [0.8, 1.28].
    old_shift = (
        torch.rand(len(REWARDS), MAX_NEW, generator=torch.Generator().manual_seed(1)) - 0.5
    ) * 0.8
    old_shift = old_shift.to(torch.float64)
    trl_loss, trl_grads, inputs = trl_loss_and_grads(
        model, tokenizer, tmp_path, loss_type, scale_rewards, old_shift
    )
    our_loss, our_grads, advantages = our_loss_and_grads(
        ours_model, inputs, target, mode, max_len, old_shift
    )
    prompt_width = inputs["prompt_ids"].size(1)
    ratio = torch.exp(-old_shift[:, : inputs["completion_mask"].size(1)])
    clipped = (ratio < 1 - CLIP_LOW) | (ratio > 1 + CLIP_HIGH)
    assert clipped[inputs["completion_mask"].bool()].any()  # the clip is exercised
    assert torch.allclose(advantages[:, prompt_width], inputs["advantages"], atol=1e-5, rtol=0)
    assert inputs["advantages"][4:8].abs().max() == 0  # the group of equal rewards
    assert inputs["advantages"].abs().max() > 0.1
    assert abs(float(our_loss - trl_loss)) < 1e-5, (float(our_loss), float(trl_loss))
    assert abs(float(trl_loss)) > 1e-3  # a loss that is not trivially zero
    assert trl_grads.keys() == our_grads.keys()
    for name, grad in trl_grads.items():
        assert torch.allclose(our_grads[name], grad, atol=1e-5, rtol=0), name
    assert max(g.abs().max() for g in trl_grads.values()) > 1e-3


def test_the_comparison_fails_when_the_aggregation_differs(tmp_path) -> None:
    """The check above is not vacuous: TRL's ``grpo`` loss (sequence mean of token means) is not
    our token mean on the same samples."""
    tokenizer = build_char_tokenizer()
    model = load_actor("tiny-char", tokenizer=tokenizer, hidden_size=32, num_layers=1, seed=0)
    model = model.to(torch.float64)
    ours_model = copy.deepcopy(model)
    old_shift = torch.zeros(len(REWARDS), MAX_NEW, dtype=torch.float64)
    trl_loss, _, inputs = trl_loss_and_grads(model, tokenizer, tmp_path, "grpo", "group", old_shift)
    our_loss, _, _ = our_loss_and_grads(
        ours_model, inputs, GRPO(eps=1e-4), "token_mean", None, old_shift
    )
    assert abs(float(our_loss - trl_loss)) > 1e-4
