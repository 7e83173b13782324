"""Memory accounting for FSDP2 training of the actor and the critic (per rank / per GPU).

:func:`fsdp_bytes_per_rank` is what ``benchmarks/fsdp_memory.py`` prints beside its measurements
and what the GPU recipes' headers quote (``benchmarks/_common.py: recipe_memory_line``, for the
Qwen2.5 shapes there). It counts the sharded training state only:

- parameters (``param_bytes`` each, fp32 by default: FSDP2 keeps fp32 shards even under a bf16
  ``MixedPrecisionPolicy``), gradients (same dtype as the shards), AdamW's two moments (fp32);
  all divided by the number of ranks;
- plus the largest transient: one transformer block (or the embedding) all-gathered unsharded in
  the compute dtype, for the actor and the critic.

Activations, the rollout engine's KV cache and allocator slack are not counted (they depend on the
batch and the engine's settings).
"""

from __future__ import annotations

import torch
from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig

from brace_lightning.models.parallelize import transformer_blocks


def parameter_counts(config: PretrainedConfig) -> dict[str, int]:
    """``{"actor", "critic", "largest_unit"}`` parameter counts of the actor and the critic of
    ``config`` (built on the meta device: no memory), ``largest_unit`` being the biggest FSDP unit
    gathered at once (a block, or the root's embedding and head)."""
    with torch.device("meta"):
        actor = AutoModelForCausalLM.from_config(config)
        backbone = AutoModel.from_config(config)
    hidden = config.get_text_config().hidden_size
    block = max(sum(p.numel() for p in b.parameters()) for b in transformer_blocks(actor))
    root = sum(p.numel() for p in actor.parameters()) - sum(
        p.numel() for b in transformer_blocks(actor) for p in b.parameters()
    )
    return {
        "actor": sum(p.numel() for p in actor.parameters()),
        "critic": sum(p.numel() for p in backbone.parameters()) + hidden + 1,
        "largest_unit": max(block, root),
    }


def fsdp_bytes_per_rank(
    config: PretrainedConfig,
    world_size: int,
    *,
    param_bytes: int = 4,
    compute_bytes: int = 4,
    optimizer_bytes: int = 8,
) -> int:
    """Bytes of sharded training state per rank for the actor plus the critic (see the module
    docstring): ``(params + grads + optimizer) / world_size`` plus one unsharded unit per model.

    Args:
        config: the actor's config (the critic has the same backbone).
        world_size: number of FSDP ranks (GPUs).
        param_bytes: bytes per sharded parameter (and gradient): 4 for fp32 shards.
        compute_bytes: bytes per gathered parameter: 2 under bf16 mixed precision, else 4.
        optimizer_bytes: optimizer state per parameter: 8 for AdamW's fp32 moments.

    Raises:
        ValueError: when ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError(f"fsdp_bytes_per_rank got world_size={world_size}; expected >= 1.")
    counts = parameter_counts(config)
    total = counts["actor"] + counts["critic"]
    sharded = total * (2 * param_bytes + optimizer_bytes) / world_size
    return int(sharded + 2 * counts["largest_unit"] * compute_bytes)
