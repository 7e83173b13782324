"""Memory accounting for FSDP2 training of the actor and the critic (per rank / per GPU).

:func:`fsdp_bytes_per_rank` is what ``benchmarks/fsdp_memory.py`` prints beside its measurements
and what the GPU recipes' headers quote. It counts the sharded training state only:

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
from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig, Qwen2Config

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


#: Shapes of the checkpoints the GPU recipes name (from their ``config.json``), so that the memory
#: per GPU can be computed offline: hidden, intermediate, layers, attention heads, KV heads.
QWEN2_SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": (896, 4864, 24, 14, 2),
    "Qwen/Qwen2.5-1.5B-Instruct": (1536, 8960, 28, 12, 2),
}


def qwen2_config(name: str, *, layers: int | None = None) -> Qwen2Config:
    """The config of a checkpoint of :data:`QWEN2_SHAPES` (vocabulary 151,936, tied embeddings),
    with ``layers`` blocks instead of its own when given.

    Raises:
        ValueError: for a name outside :data:`QWEN2_SHAPES`.
    """
    if name not in QWEN2_SHAPES:
        raise ValueError(f"qwen2_config got {name!r}; expected one of {', '.join(QWEN2_SHAPES)}.")
    hidden, intermediate, depth, heads, kv_heads = QWEN2_SHAPES[name]
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=depth if layers is None else layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def recipe_memory_line(name: str, world_size: int) -> str:
    """The memory line of a GPU recipe's header for actor ``name`` on ``world_size`` GPUs under
    bf16 compute (the tests check each recipe's header against it)."""
    gib = fsdp_bytes_per_rank(qwen2_config(name), world_size, compute_bytes=2) / 2**30
    return (
        f"# Expected memory per GPU: {gib:.1f} GiB of training state for actor + critic on "
        f"{world_size} GPU(s) (brace_lightning.models.memory.fsdp_bytes_per_rank: fp32 shards, "
        "grads and AdamW / GPUs + one bf16 block gathered per model), plus activations and engine."
    )
