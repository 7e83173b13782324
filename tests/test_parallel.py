"""FSDP2 (``models/parallelize.py``) and data parallelism (DDP / ``ModelParallelStrategy``).

Unit tests run in this process on a 1-rank gloo group. The slow tests launch 2-process gloo runs
on CPU as subprocesses (``tests/support/parallel_driver.py``; Lightning starts the second rank) and check
that the ranks agree, that 2 ranks × 4 rows give the update of 1 process × 8 rows, and that a
sharded checkpoint resumes to the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from brace_lightning.data import PublishTarget, RolloutDataModule
from brace_lightning.models import ValueModel, build_char_tokenizer, load_actor
from brace_lightning.models.handoff import ActorHandoff
from brace_lightning.models.parallelize import (
    data_parallel_mesh,
    full_state_dict,
    is_sharded,
    mixed_precision_dtypes,
    parallelize,
    transformer_blocks,
)
from brace_lightning.models.policy import token_logprobs
from brace_lightning.models.weight_sync import (
    DEFAULT_BUCKET_MB,
    MIB,
    gather_state_dict,
    gathered_buckets,
    plan_buckets,
)
from brace_lightning.module import BraceModule
from brace_lightning.objectives import PPOEWMA
from brace_lightning.ranks import combine_rank_metrics
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.targets import GRPO
from brace_lightning.tasks import ArithmeticReward, ArithmeticTask
from tests.support.dist_support import one_process_group, spawn_gloo_ranks

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "support" / "parallel_driver.py"
CONFIGS = ROOT / "configs"


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A (data_parallel=1, tensor_parallel=1) CPU mesh over a 1-rank gloo group, as Lightning's."""
    with one_process_group():
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))


def tiny_actor(layers: int = 2) -> nn.Module:
    return load_actor(
        "tiny-char", tokenizer=build_char_tokenizer(), hidden_size=64, num_layers=layers
    )


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def test_parallelize_shards_every_block_then_the_root_and_is_idempotent(mesh: DeviceMesh) -> None:
    actor = tiny_actor()
    reference = {k: v.clone() for k, v in actor.state_dict().items()}
    critic = ValueModel.from_actor(actor)
    for model in (actor, critic):
        assert not is_sharded(model)
        assert parallelize(model, mesh) is model
        blocks = list(transformer_blocks(model))
        assert len(blocks) == 2 and all(isinstance(b, FSDPModule) for b in blocks)
        assert isinstance(model, FSDPModule)
        parallelize(model, mesh, activation_checkpointing=True)  # second call: no change
        assert list(transformer_blocks(model)) == blocks
        assert not any(isinstance(m, CheckpointWrapper) for m in model.modules())
        assert sum(isinstance(m, FSDPModule) for m in model.modules()) == 3
    gathered = full_state_dict(actor)
    assert list(gathered) == list(reference)
    assert all(torch.equal(gathered[k], reference[k]) for k in reference)
    assert all(v.device.type == "cpu" and not hasattr(v, "placements") for v in gathered.values())


def test_activation_checkpointing_wraps_blocks_keeps_names_and_gradients(mesh: DeviceMesh) -> None:
    plain, checkpointed = tiny_actor(), tiny_actor()
    parallelize(plain, mesh)
    parallelize(checkpointed, mesh, activation_checkpointing=True)
    assert all(isinstance(b, CheckpointWrapper) for b in transformer_blocks(checkpointed))
    assert not any(isinstance(b, CheckpointWrapper) for b in transformer_blocks(plain))
    assert list(full_state_dict(checkpointed)) == list(full_state_dict(plain))
    ids, attn = _inputs()
    for model in (plain, checkpointed):
        model(input_ids=ids, attention_mask=attn).logits.square().mean().backward()
    for (name, a), (_, b) in zip(
        plain.named_parameters(), checkpointed.named_parameters(), strict=True
    ):
        assert torch.allclose(a.grad.full_tensor(), b.grad.full_tensor(), atol=1e-6), name


def test_mixed_precision_policy_sets_the_compute_dtype(mesh: DeviceMesh) -> None:
    ids, attn = _inputs()
    full, half = tiny_actor(1), tiny_actor(1)
    parallelize(full, mesh)
    parallelize(half, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert full(input_ids=ids, attention_mask=attn).logits.dtype == torch.float32
    assert half(input_ids=ids, attention_mask=attn).logits.dtype == torch.bfloat16


def engine_model(actor: nn.Module, bucket_bytes: int | None = DEFAULT_BUCKET_MB * MIB) -> nn.Module:
    return ActorHandoff(actor, bucket_bytes=bucket_bytes).engine_model()


def test_engine_model_is_a_plain_model_with_the_same_outputs(mesh: DeviceMesh) -> None:
    actor = tiny_actor()
    assert engine_model(actor) is actor  # nothing to gather: the engines copy it themselves
    ids, attn = _inputs()
    with torch.no_grad():
        expected = actor(input_ids=ids, attention_mask=attn).logits
    parallelize(actor, mesh, activation_checkpointing=True)
    copy = engine_model(actor)
    assert not is_sharded(copy) and type(copy).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        assert torch.allclose(copy(input_ids=ids, attention_mask=attn).logits, expected, atol=1e-6)


def test_data_parallel_mesh_picks_the_data_parallel_dimension(mesh: DeviceMesh) -> None:
    dp = data_parallel_mesh(mesh)
    assert dp.ndim == 1 and dp.mesh_dim_names == ("data_parallel",)
    assert data_parallel_mesh(dp) is dp


def test_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no transformer blocks in Sequential"):
        transformer_blocks(nn.Sequential(nn.Linear(2, 2)))


def _attach(module: BraceModule, strategy: Any) -> None:
    module._trainer = SimpleNamespace(strategy=strategy)  # type: ignore[assignment]


def test_configure_model_only_shards_under_model_parallel_strategy() -> None:
    module = BraceModule(tiny_hidden_size=64, tiny_num_layers=1)
    module.configure_model()  # no trainer: nothing to do
    _attach(module, SimpleNamespace())
    module.configure_model()  # DDP / single device: nothing to do
    assert not is_sharded(module.actor) and not is_sharded(module.critic)
    checkpointing = BraceModule(
        tiny_hidden_size=64, tiny_num_layers=1, activation_checkpointing=True
    )
    _attach(checkpointing, SimpleNamespace())
    checkpointing.configure_model()  # without FSDP2: transformers' gradient checkpointing
    assert not is_sharded(checkpointing.actor)
    for base in (checkpointing.actor, checkpointing.critic.backbone):
        assert base.is_gradient_checkpointing


def test_ewma_actor_with_fsdp_is_a_clear_error() -> None:
    module = BraceModule(
        tiny_hidden_size=64, tiny_num_layers=1, actor_objective=PPOEWMA(ewma_decay=0.9)
    )
    _attach(module, ModelParallelStrategy())
    with pytest.raises(ValueError, match="ewma_decay is not supported with ModelParallelStrategy"):
        module.configure_model()


def test_combine_rank_metrics_sums_counts_maxes_maxima_and_averages_the_rest() -> None:
    combined = combine_rank_metrics(
        [
            {"rollout/reward": 0.0, "weights/w_max": 2.0, "data/count/generated": 8.0, "a": 1.0},
            {"rollout/reward": 1.0, "weights/w_max": 3.0, "data/count/generated": 8.0},
        ]
    )
    assert combined == {
        "a": 1.0,
        "data/count/generated": 16.0,
        "rollout/reward": 0.5,
        "weights/w_max": 3.0,
    }


def test_data_module_state_is_kept_per_rank() -> None:
    data = RolloutDataModule(task=ArithmeticTask(), reward=ArithmeticReward())
    state = data.state_dict()
    assert "per_rank" not in state  # a single process keeps the old layout
    two = SimpleNamespace(trainer=SimpleNamespace(world_size=2, global_rank=1))
    assert RolloutDataModule._rank_state(two, {"per_rank": [{"r": 0}, {"r": 1}]}) == {"r": 1}
    with pytest.raises(ValueError, match="holds the state of 1 rank"):
        RolloutDataModule._rank_state(two, state)
    assert data._gather_rank_states(state) is state


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "64"])
def test_publish_bucket_size_must_be_none_or_a_positive_integer(bad: object) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^weight_sync_bucket_mb must be None \(gather the whole state dict at once\) or an "
        rf"integer number of MiB >= 1; got {re.escape(repr(bad))}\.$",
    ):
        BraceModule(tiny_hidden_size=64, tiny_num_layers=1, weight_sync_bucket_mb=bad)


def test_publish_bucket_plan_keeps_the_order_and_puts_a_large_tensor_alone() -> None:
    state = {
        "a": torch.zeros(4),  # 16 bytes
        "b": torch.zeros(4),
        "big": torch.zeros(100),  # 400 bytes, larger than a bucket
        "c": torch.zeros(2),
        "d": torch.zeros(8),
    }
    assert plan_buckets(state, 40) == [["a", "b"], ["big"], ["c", "d"]]
    assert plan_buckets(state, 1) == [["a"], ["b"], ["big"], ["c"], ["d"]]
    with pytest.raises(ValueError, match=r"^plan_buckets got bucket_bytes=0; expected an int >= 1"):
        plan_buckets(state, 0)


def test_publish_buckets_on_one_rank_equal_full_state_dict_with_tied_weights_once(
    mesh: DeviceMesh,
) -> None:
    actor = parallelize(tiny_actor(layers=2), mesh, activation_checkpointing=True)
    reference = full_state_dict(actor)
    buckets = list(gathered_buckets(actor, bucket_bytes=5000))
    assert len(buckets) > 2
    merged = {name: t for bucket in buckets for name, t in bucket.items()}
    assert set(merged) == set(reference) and len(merged) == sum(len(b) for b in buckets)
    assert all(torch.equal(merged[name], reference[name]) for name in reference)
    # tied embeddings: gathered once, given under both names in the same bucket
    assert merged["lm_head.weight"] is merged["model.embed_tokens.weight"]
    with pytest.raises(
        ValueError,
        match=r"^gathered_buckets got dst=1; expected None \(every rank receives\) or a global "
        r"rank in \[0, 1\)\.$",
    ):
        next(gathered_buckets(actor, bucket_bytes=5000, dst=1))
    assert gather_state_dict(actor, bucket_bytes=5000, dst=0) is not None


class _CollectingData(PublishTarget):
    """Keeps copies of every published stream's buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.published: list[tuple[list[dict[str, torch.Tensor]], int]] = []

    def publish(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        copies = [{k: v.clone() for k, v in bucket.items()} for bucket in buckets]
        self.published.append((copies, version))


class _FirstBucketData(_CollectingData):
    """Takes the first bucket of each stream and leaves the rest (the module must drain it)."""

    def publish(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        self.published.append(([dict(next(iter(buckets)))], version))


def _connect(module: BraceModule, data: PublishTarget) -> None:
    module._trainer = SimpleNamespace(datamodule=data)  # type: ignore[assignment]
    module.setup("fit")  # builds the hand-off and connects it


def test_publish_from_a_sharded_module_streams_buckets_or_one_dict_and_checks_finiteness(
    mesh: DeviceMesh,
) -> None:
    module = BraceModule(tiny_hidden_size=64, tiny_num_layers=1, weight_sync_bucket_mb=1)
    parallelize(module.actor, mesh)
    reference = full_state_dict(module.actor)
    for bucket_mb in (1, None):  # buckets, then the whole-dict path
        module.weight_sync_bucket_bytes = None if bucket_mb is None else bucket_mb * MIB
        data = _CollectingData()
        _connect(module, data)
        assert data.handoff is module.handoff
        module._publish()
        [(buckets, version)] = data.published
        weights = {name: t for bucket in buckets for name, t in bucket.items()}
        assert version == module.policy_version and set(weights) == set(reference)
        assert all(torch.equal(weights[name], reference[name]) for name in reference)
    module.weight_sync_bucket_bytes = MIB
    first = _FirstBucketData()
    _connect(module, first)
    module._publish()  # the stream is run to its end although the data module stopped early
    assert len(first.published) == 1
    with torch.no_grad():
        module.actor.model.norm.weight.to_local()[0] = float("nan")
    with pytest.raises(
        FloatingPointError,
        match=r"^the actor's weights became non-finite at rollout step -1 \(1 of \d+ tensors, "
        r"first 'model.norm.weight'\)",
    ):
        module._publish()
    assert len(first.published) == 1  # nothing was published


def test_publish_to_a_lagged_data_module_keeps_a_copy_of_the_buckets() -> None:
    actor = tiny_actor(layers=1)
    data = RolloutDataModule(task=ArithmeticTask(), reward=ArithmeticReward(), lag=1)
    data.engine = EmbeddedEngine(actor)
    data._history[0] = {k: v.clone() for k, v in actor.state_dict().items()}

    def version(value: float) -> list[dict[str, torch.Tensor]]:
        names = list(actor.state_dict())
        weights = {k: torch.full_like(v, value) for k, v in actor.state_dict().items()}
        return [{n: weights[n] for n in names[:3]}, {n: weights[n] for n in names[3:]}]

    first = version(1.0)
    data.publish(iter(first), 1)
    assert data.engine.version == 0  # lag 1: the engine still samples with version 0
    first[1]["model.norm.weight"].fill_(7.0)  # buckets are valid during publish only: kept copied
    assert bool((data._history[1]["model.norm.weight"] == 1.0).all())
    data.publish(iter(version(2.0)), 2)
    assert data.engine.version == 1 and sorted(data._history) == [1, 2]
    assert all(bool((t == 1.0).all()) for t in data.engine.model.state_dict().values())
    with pytest.raises(ValueError, match=r"^publish got version=2; expected a version above"):
        data.publish(iter(version(3.0)), 2)


# ---------------------------------------------------------------------- multi-process runs


def _driver(out: Path, *args: str) -> list[dict[str, Any]]:
    """Run the driver (it launches its own second rank); return every rank's report."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("MASTER_PORT", None)
    done = subprocess.run(
        [sys.executable, str(DRIVER), *args[:1], "--out", str(out), *args[1:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def _weights(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return torch.load(out / "weights.pt", weights_only=True)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _assert_ranks_agree(reports: list[dict[str, Any]]) -> None:
    assert [r["rank"] for r in reports] == [0, 1] and {r["world_size"] for r in reports} == {2}
    first, second = reports
    assert first["checksum"] == second["checksum"]
    assert first["policy_version"] == second["policy_version"]
    assert first["metrics"] == second["metrics"]  # combined over ranks before logging


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single")
    _driver(out, "fixed", "--steps", "2")
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "pack"), [("fsdp", False), ("ddp", False), ("fsdp", True), ("ddp", True)]
)
def test_two_ranks_train_like_one_process_on_the_concatenated_batch(
    strategy: str, pack: bool, single_run: Path, tmp_path: Path
) -> None:
    # A 12-token budget cuts rank 0's rows into 3 micro-batches and rank 1's into 4: rank 0 splits
    # one more so both run the same number of forwards and backwards (FSDP2 and DDP need it), and
    # the result must still equal the single process's, which has no budget. With packing the
    # budget counts real tokens (here the same plans) and every forward runs on packed rows.
    common = ("--devices", "2", "--steps", "2", "--max-tokens", "12", *(["--pack"] if pack else []))
    reports = _driver(tmp_path, "fixed", "--strategy", strategy, *common)
    _assert_ranks_agree(reports)
    assert reports[0]["sharded"] is (strategy == "fsdp")
    assert reports[0]["packed"] is pack
    assert reports[0]["published"] == [1, 2]  # full, unsharded weights after every step
    single, initial = _weights(single_run), BraceModule(tiny_hidden_size=64, tiny_num_layers=2)
    parallel = _weights(tmp_path)
    for name in ("actor", "critic"):
        start = {k: v.detach() for k, v in getattr(initial, name).state_dict().items()}
        moved = _max_diff(single[name], start)
        assert moved > 1e-2, f"{name} barely trained ({moved})"
        assert _max_diff(parallel[name], single[name]) < 1e-5
    expected = json.loads((single_run / "rank0.json").read_text())["metrics"]
    for got, want in zip(reports[0]["metrics"], expected, strict=True):
        for key in ("critic/loss", "actor/grad_norm", "critic/grad_norm", "actor/ratio_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "target"),
    [("fsdp", "GRPO"), ("ddp", "GRPO"), ("ddp", "GRPO_OPOB"), ("fsdp", "GRPO_OPOB_LOGITS")],
)
def test_two_ranks_train_a_critic_free_target_like_one_process(
    strategy: str, target: str, tmp_path: Path
) -> None:
    # GRPO's groups (rows 2g, 2g+1) stay whole on a rank, so the group statistics need no
    # reduction; the sequence-mean aggregation divides by the rows of both ranks. Rank 0 cuts its
    # rows into more micro-batches than the single process (12-token budget), on packed rows.
    # GRPO_OPOB: each rank's per-row autograd.grad passes (VCPO's optimal baseline) leave DDP's
    # gradient averaging of the update intact. GRPO_OPOB_LOGITS: its forward-only norms run on
    # the sharded actor, micro-batch by micro-batch as the scoring (exact norms are refused there).
    grpo = ("--target", target, "--aggregation", "seq_mean_token_mean", "--steps", "2")
    _driver(tmp_path / "single", "fixed", *grpo)
    reports = _driver(
        tmp_path / "two",
        "fixed",
        "--strategy",
        strategy,
        "--devices",
        "2",
        "--max-tokens",
        "12",
        "--pack",
        *grpo,
    )
    _assert_ranks_agree(reports)
    assert reports[0]["sharded"] is (strategy == "fsdp") and reports[0]["policy_version"] == 2
    single, parallel = _weights(tmp_path / "single"), _weights(tmp_path / "two")
    assert list(single) == list(parallel) == ["actor"]  # no critic built
    start = BraceModule(value_target=GRPO(), tiny_hidden_size=64, tiny_num_layers=2)
    assert _max_diff(single["actor"], dict(start.actor.state_dict())) > 1e-2
    assert _max_diff(parallel["actor"], single["actor"]) < 1e-5


@pytest.mark.slow
def test_sharded_checkpoint_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    common = ("--strategy", "fsdp", "--devices", "2", "--steps", "3")
    # Activation checkpointing recomputes the same float ops: it must not change the weights.
    _assert_ranks_agree(_driver(straight, "fixed", *common, "--activation-checkpointing"))
    _driver(first, "fixed", *common, "--stop-after", "2")
    checkpoint = first / "ckpt"
    assert checkpoint.is_dir() and len(list(checkpoint.glob("*.distcp"))) == 2  # one per rank
    reports = _driver(resumed, "fixed", *common, "--resume", str(checkpoint))
    _assert_ranks_agree(reports)
    assert reports[0]["rollout_step"] == 3 and reports[0]["published"] == [3]
    for name in ("actor", "critic"):
        assert _max_diff(_weights(resumed)[name], _weights(straight)[name]) == 0.0


def _cli(root: Path, *overlays: str, steps: int = 3, warm_start: bool = False) -> list[str]:
    """Driver arguments of a small CLI run of the quickstart plus ``overlays``; Lightning writes
    its config and checkpoints under ``root``. ``warm_start`` keeps the quickstart's
    SupervisedWarmStart (2 steps) instead of removing the callbacks."""
    args = ["cli", "--", "fit", "--config", str(CONFIGS / "quickstart.yaml")]
    for overlay in overlays:
        args += ["--config", str(CONFIGS / overlay)]
    return [
        *args,
        *(
            ["--trainer.callbacks.init_args.steps=2", "--trainer.callbacks.init_args.num_pairs=64"]
            if warm_start
            else ["--trainer.callbacks=[]"]
        ),
        f"--trainer.default_root_dir={root}",
        f"--trainer.limit_train_batches={steps}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--model.tiny_hidden_size=64",
        "--model.tiny_num_layers=1",
        "--model.critic_warmup_steps=0",
        "--data.prompts_per_step=2",
        "--data.samples_per_prompt=2",
        "--data.engine.init_args.max_new_tokens=8",
        # An untrained tiny model earns reward 0 everywhere: keep the actor's path under test.
        "--model.skip_equal_reward_batches=false",
    ]


@pytest.mark.slow
def test_fsdp_recipe_ranks_draw_their_own_prompts_and_resume_from_a_sharded_checkpoint(
    tmp_path: Path,
) -> None:
    recipe = "fsdp/cpu_2proc.yaml"
    straight = _driver(tmp_path / "straight", *_cli(tmp_path, recipe))
    _assert_ranks_agree(straight)
    assert straight[0]["sharded"] and straight[0]["policy_version"] == 3
    assert straight[0]["prompt_stream"] != straight[1]["prompt_stream"]
    assert straight[0]["counters"]["trained"] == 3 * 2 * 2  # per rank
    ckpt = tmp_path / "ckpt"
    _driver(
        tmp_path / "first",
        *_cli(tmp_path, recipe),
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpt}",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.max_steps=1",  # stops (and saves) after the first rollout step
    )
    (checkpoint,) = ckpt.iterdir()
    assert checkpoint.is_dir()  # a sharded checkpoint is a folder
    resumed = _driver(
        tmp_path / "resumed",
        *_cli(tmp_path, recipe),
        f"--ckpt_path={checkpoint}",
    )
    for got, want in zip(resumed, straight, strict=True):
        assert got["checksum"] == want["checksum"]  # every rank's prompts, engine RNG, weights
        assert got["prompt_stream"] == want["prompt_stream"]
        assert got["counters"] == want["counters"]


@pytest.mark.slow
def test_ddp_recipe_with_the_quickstart_warm_start_ranks_agree(tmp_path: Path) -> None:
    reports = _driver(
        tmp_path / "run",
        *_cli(tmp_path, "ddp/cpu_2proc.yaml", steps=2, warm_start=True),
    )
    _assert_ranks_agree(reports)
    assert not reports[0]["sharded"] and reports[0]["policy_version"] == 2
    assert reports[0]["prompt_stream"] != reports[1]["prompt_stream"]


@pytest.mark.slow
def test_fsdp_recipe_with_the_quickstart_warm_start_ranks_agree(tmp_path: Path) -> None:
    # The warm start trains the unsharded actor in setup, before FSDP2 shards it (it used to fail
    # with "FSDP does not support deepcopy" when copying the sharded actor into the critic).
    reports = _driver(
        tmp_path / "run",
        *_cli(tmp_path, "fsdp/cpu_2proc.yaml", steps=1, warm_start=True),
    )
    _assert_ranks_agree(reports)
    assert reports[0]["sharded"] and reports[0]["policy_version"] == 1


def test_mixed_precision_dtypes_follow_the_setting_and_the_device() -> None:
    assert mixed_precision_dtypes("auto", "cpu") == (None, None)
    assert mixed_precision_dtypes("auto", "cuda") == (torch.bfloat16, torch.float32)
    assert mixed_precision_dtypes("bf16", "cpu") == (torch.bfloat16, torch.float32)
    assert mixed_precision_dtypes("fp32", "cuda") == (None, None)
    with pytest.raises(ValueError, match="fsdp_mixed_precision must be one of auto, bf16, fp32"):
        mixed_precision_dtypes("fp16", "cuda")
    with pytest.raises(ValueError, match="fsdp_mixed_precision must be one of"):
        BraceModule(tiny_hidden_size=64, tiny_num_layers=1, fsdp_mixed_precision="half")


#: bf16 parameters keep 8 bits of mantissa. Measured on this tiny model: log-probs (about -4.6)
#: move by 1.3e-3 at most, values (|V| < 1e-2) by 9e-5, the value head's gradient by 0.6% in norm;
#: the bounds leave 3-8x room.
BF16_LOGPROB_ATOL = 1e-2
BF16_VALUE_ATOL = 3e-4
BF16_GRAD_RTOL = 0.02


def test_bf16_mixed_precision_matches_the_fp32_path_within_tolerance(mesh: DeviceMesh) -> None:
    ids, attn = _inputs()
    results = {}
    for setting in ("fp32", "bf16"):
        actor = tiny_actor()
        critic = ValueModel.from_actor(actor, seed=1)
        param_dtype, reduce_dtype = mixed_precision_dtypes(setting, "cpu")
        for model in (actor, critic):
            parallelize(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        logprobs, _ = token_logprobs(actor, ids, attn)
        values = critic(ids, attn)
        values.sum().backward()
        results[setting] = (logprobs.detach(), values.detach(), critic.value_head.weight.grad)
        assert logprobs.dtype == values.dtype == torch.float32
        # Sharded parameters and their gradients stay fp32; the value head is fp32 in the forward.
        assert all(p.dtype == torch.float32 for p in critic.parameters())
        assert critic.value_head.weight.grad.dtype == torch.float32
        assert isinstance(critic.value_head, FSDPModule) == (setting == "bf16")
    (lp32, v32, g32), (lp16, v16, g16) = results["fp32"], results["bf16"]
    assert not torch.equal(lp32, lp16)  # bf16 compute really ran
    assert (lp32 - lp16).abs().max() < BF16_LOGPROB_ATOL
    assert (v32 - v16).abs().max() < BF16_VALUE_ATOL
    g32, g16 = g32.full_tensor(), g16.full_tensor()
    assert (g16 - g32).norm() < BF16_GRAD_RTOL * g32.norm()


def test_cpu_offload_on_a_cpu_mesh_is_a_clear_error(mesh: DeviceMesh) -> None:
    with pytest.raises(ValueError, match="cpu_offload=True on a 'cpu' device mesh"):
        parallelize(tiny_actor(1), mesh, cpu_offload=True)


# ---------------------------------------------------------------- publishing weights in buckets


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ in keys, dtype, shape or any bit (empty when identical)."""
    if set(a) != set(b):
        return sorted(set(a) ^ set(b))
    return [
        name
        for name in a
        if a[name].dtype != b[name].dtype
        or a[name].shape != b[name].shape
        or not torch.equal(_bits(a[name]), _bits(b[name]))
    ]


def _publish_rank_main(rank: int, out: str) -> None:
    """Rank ``rank`` of a 2-rank gloo run: engines built from the initial actor, the shards then
    changed, and the new weights published today's way and in buckets; results to ``out``."""
    from brace_lightning.models.weight_sync import gather_state_dict, gathered_buckets
    from brace_lightning.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    actor = load_actor(
        "tiny-char", tokenizer=build_char_tokenizer(), hidden_size=64, num_layers=3, seed=5
    )
    parallelize(actor, mesh, activation_checkpointing=True)
    old_engine = EmbeddedEngine(engine_model(actor, bucket_bytes=None))
    engines = {size: EmbeddedEngine(engine_model(actor)) for size in (1, 6000)}
    dm = RolloutDataModule(task=ArithmeticTask(), reward=ArithmeticReward())
    dm.engine = EmbeddedEngine(engine_model(actor, bucket_bytes=4096))
    with torch.no_grad():  # new weights, different on each rank's shards
        generator = torch.Generator().manual_seed(100 + rank)
        for param in actor.parameters():
            local = param.to_local()
            local.add_(torch.randn(local.shape, generator=generator))
    reference = full_state_dict(actor)  # today's path: the full dict on every rank
    old_engine.update_weights(reference, 1)
    for size, engine in engines.items():
        engine.update_weights_from_buckets(gathered_buckets(actor, bucket_bytes=size), 1)
    dm.publish(ActorHandoff(actor, bucket_bytes=6000).buckets(), 1)
    to_rank0 = gather_state_dict(actor, bucket_bytes=6000, dst=0)
    results = {
        "old_engine": _bit_identical(old_engine.model.state_dict(), reference),
        **{
            f"engine_{size}": _bit_identical(engine.model.state_dict(), reference)
            for size, engine in engines.items()
        },
        "datamodule": _bit_identical(dm.engine.model.state_dict(), reference),
        "versions": [e.version for e in (*engines.values(), dm.engine)],
        "rank0": None if to_rank0 is None else _bit_identical(to_rank0, reference),
        "copy": _bit_identical(engine_model(actor).state_dict(), reference),
        "changed": not torch.equal(
            reference["model.norm.weight"], torch.ones_like(reference["model.norm.weight"])
        ),
    }
    torch.save(results, f"{out}/publish{rank}.pt")


@pytest.mark.slow
def test_publish_in_buckets_gives_the_engines_bit_identical_weights_on_two_ranks(
    tmp_path: Path,
) -> None:
    spawn_gloo_ranks(_publish_rank_main, str(tmp_path))
    for rank in range(2):
        results = torch.load(tmp_path / f"publish{rank}.pt")
        assert results["changed"]  # the engines had to install new weights
        for key in ("old_engine", "engine_1", "engine_6000", "datamodule", "copy"):
            assert results[key] == [], (rank, key, results[key])
        assert results["versions"] == [1, 1, 1]
        assert results["rank0"] == ([] if rank == 0 else None)  # only rank 0 receives


def _memory_rank_main(rank: int, out: str) -> None:
    """Peak extra host RSS of each publish path on rank ``rank`` of a 2-rank gloo run."""
    import ctypes
    import gc

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config

    from brace_lightning.models.weight_sync import MIB, drain, gathered_buckets
    from brace_lightning.rollout.engine import copy_buckets

    def reset() -> int:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def peak() -> int:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        tie_word_embeddings=True,
    )
    actor = AutoModelForCausalLM.from_config(config)
    model_bytes = sum(p.numel() * 4 for p in actor.parameters())
    parallelize(actor, init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",)))
    # zeros, not empty: the pages of the stand-in engine are touched before the measurement
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in actor.state_dict().items()}
    peaks = {}
    for mode in ("full", "every_rank", "rank0"):
        dist.barrier()
        base = reset()
        if mode == "full":
            weights = full_state_dict(actor)
            del weights
        else:
            buckets = gathered_buckets(
                actor, bucket_bytes=4 * MIB, dst=0 if mode == "rank0" else None
            )
            if mode == "every_rank" or rank == 0:
                copy_buckets(buckets, target)  # what an engine does with each bucket
            drain(buckets)
        peaks[mode] = peak() - base
    torch.save({"peaks": peaks, "model_bytes": model_bytes}, f"{out}/memory{rank}.pt")


@pytest.mark.slow
def test_publish_peak_memory_of_a_rank_is_bounded_by_the_bucket_not_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from brace_lightning.models.weight_sync import MIB

    # Freed tensors go back to the OS at once, so a peak cannot hide in reused heap memory.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    spawn_gloo_ranks(_memory_rank_main, str(tmp_path))
    for rank in range(2):
        report = torch.load(tmp_path / f"memory{rank}.pt")
        peaks, model_bytes = report["peaks"], report["model_bytes"]
        # today's path: every rank holds the whole model (the tied embedding twice) at once
        assert peaks["full"] > model_bytes, (rank, peaks, model_bytes)
        # buckets of 4 MiB, the largest tensor (the embedding) 4 MiB: a receiving rank holds one
        # bucket and gloo's copy of the tensor being gathered
        assert peaks["every_rank"] < 3 * 4 * MIB, (rank, peaks)
        if rank == 0:
            assert peaks["rank0"] < 3 * 4 * MIB, peaks
        else:  # sends its shards, keeps nothing
            assert peaks["rank0"] < 4 * MIB, peaks
