"""Meta-device construction with per-rank loading (``models/meta_init.py``).

A saved Hugging Face folder is loaded into a sharded actor and critic built on the meta device;
their log-probs and values must equal those of the same folder loaded whole in one process.
The 2-rank case runs two gloo processes (``torch.multiprocessing``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks._common import qwen2_config, recipe_memory_line
from brace_lightning.models import ValueModel, build_char_tokenizer, load_actor
from brace_lightning.models.memory import fsdp_bytes_per_rank, parameter_counts
from brace_lightning.models.meta_init import (
    fill_from_safetensors,
    load_sharded_actor,
    load_sharded_critic,
)
from brace_lightning.models.parallelize import full_state_dict, parallelize
from brace_lightning.models.policy import load_causal_lm, token_logprobs
from brace_lightning.module import BraceModule
from brace_lightning.objectives import PPOEWMA
from tests.support.dist_support import one_process_group, spawn_gloo_ranks

#: fp32 on both sides; only the reduction order of the sharded forward can differ.
ATOL = 1e-5


def _save_actor(folder: Path) -> None:
    actor = load_actor(
        "tiny-char", tokenizer=build_char_tokenizer(), hidden_size=64, num_layers=3, seed=5
    )
    actor.save_pretrained(folder)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0  # a left-padded row
    return ids, attn


def _reference(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and values of ``folder`` loaded whole, without FSDP."""
    actor = load_causal_lm(str(folder))
    critic = ValueModel.from_pretrained(str(folder))
    with torch.random.fork_rng(devices=[]):
        generator = torch.Generator().manual_seed(7)
        weight = torch.randn(tuple(critic.value_head.weight.shape), generator=generator) * 1e-3
    with torch.no_grad():
        critic.value_head.weight.copy_(weight)
        critic.value_head.bias.zero_()
    ids, attn = _inputs()
    with torch.no_grad():
        return token_logprobs(actor, ids, attn)[0], critic(ids, attn)


def _sharded(folder: Path, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    actor = load_sharded_actor(folder, mesh)
    critic = load_sharded_critic(folder, mesh, seed=7)
    assert all(isinstance(p, DTensor) for p in actor.parameters())
    assert all(isinstance(p, DTensor) for p in critic.parameters())
    ids, attn = _inputs()
    with torch.no_grad():
        return token_logprobs(actor, ids, attn)[0], critic(ids, attn)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with one_process_group():
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))


def test_meta_built_sharded_actor_and_critic_match_the_whole_loaded_folder(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    _save_actor(tmp_path)
    logprobs, values = _reference(tmp_path)
    sharded_logprobs, sharded_values = _sharded(tmp_path, mesh)
    torch.testing.assert_close(sharded_logprobs, logprobs, atol=ATOL, rtol=0)
    torch.testing.assert_close(sharded_values, values, atol=ATOL, rtol=0)
    assert values.abs().max() > 0  # the value head was initialised, not left at zero


def test_critic_backbone_is_read_from_the_files_not_copied(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    _save_actor(tmp_path)
    actor = load_sharded_actor(tmp_path, mesh)
    critic = load_sharded_critic(tmp_path, mesh)
    embed = critic.backbone.embed_tokens.weight
    assert embed.to_local().data_ptr() != actor.model.embed_tokens.weight.to_local().data_ptr()
    torch.testing.assert_close(embed.full_tensor(), actor.model.embed_tokens.weight.full_tensor())


def test_a_checkpoint_of_another_architecture_is_a_clear_error(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    _save_actor(tmp_path)
    bigger = load_actor("tiny-char", tokenizer=build_char_tokenizer(), hidden_size=64, num_layers=4)
    parallelize(bigger, mesh)
    with pytest.raises(ValueError, match="is not in the safetensors files"):
        fill_from_safetensors(bigger, tmp_path, key_map={})


def _rank_main(rank: int, folder: str, out: str) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    logprobs, values = _sharded(Path(folder), mesh)
    torch.save((logprobs, values), f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_two_ranks_load_their_shards_and_match_the_whole_loaded_folder(tmp_path: Path) -> None:
    _save_actor(tmp_path)
    logprobs, values = _reference(tmp_path)
    spawn_gloo_ranks(_rank_main, str(tmp_path), str(tmp_path))
    for rank in range(2):
        rank_logprobs, rank_values = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(rank_logprobs, logprobs, atol=ATOL, rtol=0)
        torch.testing.assert_close(rank_values, values, atol=ATOL, rtol=0)


class _LargestAllocation(TorchDispatchMode):
    """Records the largest storage (bytes) of any CPU tensor an op returns; a DTensor counts by
    its local shard, a view by the storage it views."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: tuple[type, ...],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, DTensor):
                tensor = tensor.to_local()
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return out


def _save_wide_vocabulary_actor(folder: Path) -> int:
    """A tied-embedding model whose embedding is by far its largest tensor; returns its bytes."""
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=2000,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return config.vocab_size * config.hidden_size * 4


def _largest_allocation_rank(rank: int, folder: str, out: str) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    with _LargestAllocation() as record:
        actor = load_sharded_actor(folder, mesh)
        critic = load_sharded_critic(folder, mesh)
    shards = {
        "actor": actor.model.embed_tokens.weight.to_local().untyped_storage().nbytes(),
        "critic": critic.backbone.embed_tokens.weight.to_local().untyped_storage().nbytes(),
    }
    torch.save((record.largest, shards), f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_two_ranks_never_allocate_a_whole_embedding_while_building_and_loading(
    tmp_path: Path,
) -> None:
    """Each rank holds half of the tied embedding; no tensor of construction and loading (to_empty,
    the file reads, the value head) may be larger than that half, e.g. the embedding read whole."""
    embedding = _save_wide_vocabulary_actor(tmp_path)
    spawn_gloo_ranks(_largest_allocation_rank, str(tmp_path), str(tmp_path))
    for rank in range(2):
        largest, shards = torch.load(tmp_path / f"rank{rank}.pt")
        assert shards == {"actor": embedding // 2, "critic": embedding // 2}
        assert largest == embedding // 2, f"rank {rank} allocated {largest} bytes"


RECIPES = {
    "configs/gpu/gsm8k_qwen0.5b_colocated.yaml": ("Qwen/Qwen2.5-0.5B-Instruct", 1),
    "configs/gpu/gsm8k_qwen1.5b_disaggregated.yaml": ("Qwen/Qwen2.5-1.5B-Instruct", 4),
    "configs/fsdp/gpu_8x.yaml": ("Qwen/Qwen2.5-1.5B-Instruct", 8),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_gpu_recipe_headers_state_the_accounted_memory_per_gpu(recipe: str) -> None:
    name, world_size = RECIPES[recipe]
    text = (Path(__file__).resolve().parents[1] / recipe).read_text()
    assert f"actor: {name}" in text
    assert recipe_memory_line(name, world_size) in text.splitlines()


def test_fsdp_accounting_is_sixteen_bytes_per_parameter_over_the_ranks_plus_gathered_units() -> (
    None
):
    config = qwen2_config("Qwen/Qwen2.5-0.5B-Instruct")
    counts = parameter_counts(config)
    # Qwen2.5-0.5B has 494,032,768 parameters (tied embeddings); the critic drops nothing (tied
    # head) and adds a 896 -> 1 head.
    assert counts["actor"] == 494_032_768
    assert counts["critic"] == counts["actor"] + 897
    assert counts["largest_unit"] == 151_936 * 896 + 896  # root unit: embedding + final norm
    total = counts["actor"] + counts["critic"]
    assert fsdp_bytes_per_rank(config, 2) == int(total * 16 / 2 + 2 * counts["largest_unit"] * 4)
    with pytest.raises(ValueError, match="world_size=0"):
        fsdp_bytes_per_rank(config, 0)


def test_from_actor_clones_the_backbone_without_deepcopy(monkeypatch: pytest.MonkeyPatch) -> None:
    actor = load_actor("tiny-char", tokenizer=build_char_tokenizer(), hidden_size=64, num_layers=1)
    # Every module refuses deepcopy, as FSDP modules do ("FSDP does not support deepcopy").
    monkeypatch.setattr(nn.Module, "__deepcopy__", _refuse, raising=False)
    with pytest.raises(AssertionError, match="deepcopy of a module"):
        copy.deepcopy(actor)
    critic = ValueModel.from_actor(actor, seed=1)
    monkeypatch.undo()
    for name, tensor in actor.base_model.state_dict().items():
        clone = critic.backbone.state_dict()[name]
        assert torch.equal(clone, tensor) and clone.data_ptr() != tensor.data_ptr(), name
    assert not any(t.is_meta for t in critic.state_dict().values())
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    with torch.no_grad():  # rotary buffers rebuilt: same hidden states as the actor's backbone
        want = actor.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
        got = critic.backbone(input_ids=ids, attention_mask=attn).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("deepcopy of a module")


def test_from_actor_refuses_a_sharded_actor(mesh: DeviceMesh) -> None:
    actor = load_actor("tiny-char", tokenizer=build_char_tokenizer(), hidden_size=64, num_layers=1)
    parallelize(actor, mesh)
    with pytest.raises(ValueError, match="from_actor got an FSDP-sharded actor"):
        ValueModel.from_actor(actor)


def test_module_meta_init_keeps_models_empty_until_sharded_and_refuses_other_strategies(
    tmp_path: Path,
) -> None:
    _save_actor(tmp_path)
    build_char_tokenizer().save_pretrained(tmp_path)
    module = BraceModule(actor=str(tmp_path), fsdp_meta_init=True)
    assert all(p.is_meta for p in module.actor.parameters())
    assert all(p.is_meta for p in module.critic.parameters())
    module._trainer = SimpleNamespace(strategy=SimpleNamespace())  # type: ignore[assignment]
    with pytest.raises(ValueError, match="fsdp_meta_init=True needs trainer.strategy"):
        module.configure_model()
    with pytest.raises(ValueError, match="ewma_decay is not supported with fsdp_meta_init=True"):
        BraceModule(
            tiny_hidden_size=64,
            tiny_num_layers=1,
            fsdp_meta_init=True,
            actor_objective=PPOEWMA(ewma_decay=0.9),
        )


def test_module_meta_init_fills_shards_with_the_usual_values(mesh: DeviceMesh) -> None:
    usual = BraceModule(tiny_hidden_size=64, tiny_num_layers=1, seed=2)
    meta = BraceModule(tiny_hidden_size=64, tiny_num_layers=1, seed=2, fsdp_meta_init=True)
    strategy = ModelParallelStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    meta._trainer = SimpleNamespace(strategy=strategy)  # type: ignore[assignment]
    meta._device_mesh = mesh  # type: ignore[attr-defined]
    meta.configure_model()
    assert meta.actor.lm_head.weight is meta.actor.model.embed_tokens.weight
    for name in ("actor", "critic"):
        want = getattr(usual, name).state_dict()
        got = full_state_dict(getattr(meta, name))
        assert list(got) == list(want)
        assert all(torch.equal(got[k], want[k]) for k in want), name
