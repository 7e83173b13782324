"""Supervised warm start: fine-tune a causal LM on (prompt, completion) pairs before RL.

RL from a randomly initialised tiny model never sees a reward, so the quickstart first teaches the
answer format with a few hundred steps of next-token prediction on reference solutions. The loss
covers the completion tokens and the closing eos only (the prompt is context, as in RL); prompts are
encoded like the rollouts' (``tasks.base.encode_prompt``: the chat template when the tokenizer has
one), so an instruction model learns the format in the context it will answer in. A plain torch
loop: AdamW, gradient clipping, a short linear warmup then cosine decay to 10% of ``lr``.

A training loop of its own, so it sits with the orchestration (next to ``callbacks.py``, whose
:class:`~brace_lightning.callbacks.SupervisedWarmStart` runs it), above the models it trains.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from brace_lightning.models.critic import ValueModel, init_value_head
from brace_lightning.models.lora import load_base_weights, merged_state_dict
from brace_lightning.tasks.base import Prompt, encode_prompt

IGNORE_INDEX = -100


def _encode_pairs(
    tokenizer: PreTrainedTokenizerBase, pairs: Sequence[tuple[str, str]]
) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` per pair; labels are IGNORE_INDEX over the prompt."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            "supervised_warm_start got a tokenizer without eos_token_id; expected one to end "
            "completions."
        )
    encoded = []
    for prompt, completion in pairs:
        # The prompt is encoded as the rollout encodes it (the chat template when the tokenizer has
        # one), the completion separately, as the engine samples it after the prompt.
        prompt_ids = encode_prompt(tokenizer, Prompt(prompt, completion))
        completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + [eos]
        encoded.append(
            (prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids)
        )
    return encoded


def _collate(
    examples: list[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, T]`` input ids, attention mask and labels."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(len(examples), width, dtype=torch.long)
    for row, (ids, targets) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(targets)
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask, labels


def _lr_factor(step: int, steps: int) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def supervised_warm_start(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[tuple[str, str]],
    *,
    steps: int = 500,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    progress: bool = False,
) -> list[float]:
    """Train ``model`` in place on completions given prompts; returns the loss of every step.

    Loss per step: mean cross-entropy over the batch's completion tokens (each completion followed
    by eos), ``−Σ log p(y_t | prompt, y_<t) / #tokens``. Batches are drawn by walking seeded random
    permutations of ``pairs``.

    Args:
        model: a causal LM returning ``.logits`` ``[B, T, V]``; its train/eval mode is restored.
        tokenizer: tokenizes prompts (default special tokens) and completions (none), gives eos.
        pairs: ``(prompt text, completion text)``.
        steps: optimizer steps.
        batch_size: pairs per step.
        lr: peak AdamW learning rate (linear warmup over 5% of steps, cosine decay to 10%).
        weight_decay: AdamW weight decay.
        max_grad_norm: gradient-norm clip.
        seed: seed of the batch order.
        progress: show a progress bar with the loss (tqdm, on stderr).
    """
    if not pairs:
        raise ValueError("supervised_warm_start got no pairs; expected at least one.")
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"supervised_warm_start got {name}={value}; expected an integer >= 1.")
    if not lr > 0:
        raise ValueError(f"supervised_warm_start got lr={lr}; expected a value > 0.")
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    examples = _encode_pairs(tokenizer, pairs)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps))
    was_training = model.training
    model.train()
    order: list[int] = []
    losses = []
    bar = tqdm(total=steps, desc="Warm start", disable=not progress, dynamic_ncols=True)
    for _ in range(steps):
        if len(order) < batch_size:
            order += torch.randperm(len(examples), generator=generator).tolist()
        batch, order = [examples[i] for i in order[:batch_size]], order[batch_size:]
        input_ids, attention_mask, labels = (t.to(device) for t in _collate(batch, pad_id))
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(),
            labels[:, 1:].flatten(),
            ignore_index=IGNORE_INDEX,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        bar.update()
    bar.close()
    # No gradient outlives the warm start: a stale .grad would be all-reduced by DDP's reducer (and
    # applied by the RL optimizer's first step) as if the RL loss had produced it.
    optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    return losses


def copy_backbone_to_critic(
    actor: torch.nn.Module, critic: ValueModel, *, seed: int, head_init_std: float = 1e-3
) -> None:
    """Load the actor's backbone weights into ``critic.backbone`` and re-initialise its value head.

    In place, on unsharded modules (no copy of the actor is made, so the critic keeps its own
    storage, device and parallel wrapping-to-be). The head is drawn as :class:`ValueModel` draws it
    (:func:`~brace_lightning.models.critic.init_value_head`) from the global generator seeded with
    ``seed``, which is restored afterwards (the CPU one; ``torch.manual_seed`` also reseeds CUDA's).
    """
    base = getattr(actor, "base_model", None)
    if base is None or base is actor:
        raise ValueError(
            f"copy_backbone_to_critic got actor of type {type(actor).__name__}; expected a causal "
            "LM whose .base_model is its backbone."
        )
    # LoRA (models/lora.py): the merged backbone, into a LoRA critic's base weights.
    load_base_weights(critic.backbone, merged_state_dict(base))
    head = critic.value_head
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        init_value_head(head.weight, head.bias, std=head_init_std)


def broadcast_from_rank_zero(*modules: torch.nn.Module) -> None:
    """Overwrite every rank's parameters and buffers with rank 0's (no-op without a process group).

    Called after a warm start that every rank ran on its own full copy, so that sharding (which
    keeps each rank's own slice) assembles one model even if the ranks' arithmetic differed.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    with torch.no_grad():
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                torch.distributed.broadcast(tensor.data, src=0)
