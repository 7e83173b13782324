"""Shadow-critic recording: per rollout step, the batch a run's critic trained on and a fresh
on-policy batch, so that critics can be trained and scored offline on one identical stream.

The open-loop critic question of issue 31 (``docs/results_lm.md``, "The critic question, open
loop"): the actor's own trajectory must not depend on which critic is being judged, so one run is
recorded (its actor driven by its own critic) and every critic variant is trained afterwards on the
same µ-batches (``benchmarks/lm_shadow_critics.py``). For every rollout step v of a ``fit`` the
actor at the start of the step is π_v, the step's π_prox, and :class:`ShadowRecorder` saves
``folder/v{v:05d}.pt`` holding:

- ``train``: the step's rollout batch as trained on (the µ-batch: tokens, masks, log µ, rewards,
  scores, group ids, versions; the task's rewards, without a ``kl_mode="reward"`` penalty) and ``target_logprobs`` = log π_v at every action: a no-grad
  forward of a copy of π_v through the module's own :class:`~brace_lightning.scorer.Scorer` (the
  code and micro-batch plan of the step's π_prox log-probs, so the two are equal);
- ``on_policy``: ``on_policy_rows`` fresh responses (one per prompt) of π_v to fresh prompts of the
  training task, sampled by the run's engine class with its settings (temperature,
  ``max_new_tokens``) and scored by the run's reward; ``behavior_logprobs`` is what the engine
  recorded (log µ = log π_v up to the engine's float error), ``target_logprobs`` the scorer's
  log π_v of the same tokens.

and ``folder/meta.json``: the run's settings (lag, learning rates, seeds, the warm-started actor),
the critic's construction (what ``models/build.py`` needs to rebuild the run's initial critic) and
the SHA-256 of that critic's initial weights, so an offline trainer can check its rebuild.

What the recorder takes from the run: nothing. Its prompts come from a ``torch.Generator`` of its
own, its engine is a second instance whose sampling generator restarts at ``seed + offset``
(:meth:`~brace_lightning.rollout.engine.RolloutEngine.offset_seed`), its forwards run on a private
eval-mode copy of the actor; so a run with the recorder logs the same metrics and ends with the same
weights as the same run without it (tests/test_shadow.py). Refused in one sentence: the
asynchronous data module (its behaviour versions depend on timing), several processes, FSDP2,
LoRA and resumed runs. Files load with ``torch.load(path, weights_only=True)`` (:func:`load_version`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from brace_lightning.data.sync import RolloutDataModule
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.rollout.engine import RolloutEngine
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.seeds import run_seed

__all__ = [
    "BATCH_KEYS",
    "SEED_OFFSET",
    "ShadowRecorder",
    "load_meta",
    "load_version",
    "state_sha256",
    "stream_sha256",
    "to_batch",
    "version_files",
]

#: Added to the run's seed for the recorder's prompt draws and its engine's sampling stream.
SEED_OFFSET = 1_000_003
#: The tensors saved per batch (``[B, T]`` unless ``[B]``), after ``target_logprobs`` (log π_v).
BATCH_KEYS = (
    "input_ids",
    "attention_mask",
    "mask",
    "behavior_logprobs",
    "rewards",
    "scores",
    "group_ids",
    "versions",
)
FORMAT = 1


def state_sha256(model: nn.Module) -> str:
    """SHA-256 over ``model``'s state dict (names and raw bytes, in name order)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def stream_sha256(folder: str | Path) -> str:
    """SHA-256 over a recording's batches: every ``v*.pt`` of ``folder`` in rollout-step order,
    its keys, numbers and tensors (dtype, shape, raw bytes). Two recordings with the same digest
    train every offline critic alike; ``meta.json``, which names local paths, is not in it."""
    digest = hashlib.sha256()
    for path in version_files(folder):
        _update_digest(digest, load_version(path))
    return digest.hexdigest()


def _update_digest(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value):
            digest.update(str(key).encode())
            _update_digest(digest, value[key])
    else:
        digest.update(repr(value).encode())


def version_files(folder: str | Path) -> list[Path]:
    """The recorded ``v*.pt`` files of ``folder``, in rollout-step order."""
    return sorted(Path(folder).glob("v[0-9]*.pt"))


def load_version(path: str | Path) -> dict[str, Any]:
    """One recorded rollout step: ``{"rollout_step", "policy_version", "temperature", "train",
    "on_policy"}``, each batch a dict of CPU tensors (:data:`BATCH_KEYS` and ``target_logprobs``)."""
    return torch.load(path, weights_only=True)


def load_meta(folder: str | Path) -> dict[str, Any]:
    """``folder/meta.json`` of a recording."""
    return json.loads((Path(folder) / "meta.json").read_text())


def to_batch(saved: dict[str, torch.Tensor]) -> tuple[RolloutBatch, torch.Tensor]:
    """A saved batch (``"train"`` or ``"on_policy"`` of :func:`load_version`) as a
    :class:`RolloutBatch` and its ``[B, T]`` log π_v (``target_logprobs``)."""
    batch = RolloutBatch(**{key: saved[key] for key in BATCH_KEYS})
    return batch, saved["target_logprobs"]


def _tensors(batch: RolloutBatch, target_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    saved = {key: getattr(batch, key).detach().cpu().clone() for key in BATCH_KEYS}
    saved["target_logprobs"] = target_logprobs.detach().cpu().clone()
    return saved


def _plain(value: Any) -> Any:
    """``value`` as JSON: numbers, strings, lists and dicts kept, anything else its ``repr``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def _optimizer_settings(optimizer: Any) -> dict[str, Any]:
    inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps it
    settings = {k: _plain(v) for k, v in inner.defaults.items() if not callable(v)}
    return {"class": f"{type(inner).__module__}.{type(inner).__name__}", **settings}


class ShadowRecorder(pl.Callback):
    """Records the µ-stream and fresh on-policy batches of a ``fit`` (module docstring).

    Args:
        folder: where ``v{step:05d}.pt`` and ``meta.json`` go (created).
        on_policy_rows: fresh on-policy responses per rollout step, one per prompt.
        seed: seed of the recorder's prompt draws (None: the run's seed + :data:`SEED_OFFSET`);
            its engine samples from the run engine's seed + :data:`SEED_OFFSET`.
    """

    def __init__(
        self, folder: str | Path, *, on_policy_rows: int = 32, seed: int | None = None
    ) -> None:
        if not isinstance(on_policy_rows, int) or on_policy_rows < 1:
            raise ValueError(
                f"ShadowRecorder got on_policy_rows={on_policy_rows!r}; expected an integer >= 1."
            )
        self.folder = Path(folder)
        self.on_policy_rows = on_policy_rows
        self.seed = seed
        self._policy: nn.Module | None = None
        self._engine: RolloutEngine | None = None
        self._prompts: torch.Generator | None = None
        self._prompt_seed: int | None = None
        self._version = 0  # the policy version of π_v, the step's actor at its start

    # ------------------------------------------------------------------ checks and meta

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> RolloutDataModule:
        datamodule = trainer.datamodule
        if not isinstance(datamodule, RolloutDataModule):
            raise ValueError(
                f"ShadowRecorder got data module {type(datamodule).__name__}; expected "
                "brace_lightning.data.RolloutDataModule (a fixed lag; the asynchronous one's "
                "behaviour versions depend on timing)."
            )
        if datamodule.env is not None:
            raise ValueError(
                "ShadowRecorder got a tool environment; expected single-turn rollouts."
            )
        if trainer.world_size != 1 or isinstance(trainer.strategy, ModelParallelStrategy):
            raise ValueError(
                f"ShadowRecorder got world_size={trainer.world_size} with "
                f"{type(trainer.strategy).__name__}; expected one process without FSDP2."
            )
        if pl_module.hparams.get("lora") is not None or pl_module.critic is None:
            raise ValueError(
                "ShadowRecorder got a LoRA actor or a critic-free value target; expected a full "
                "actor and a critic."
            )
        if pl_module.rollout_step != 0:
            raise ValueError(
                f"ShadowRecorder got a run resumed at rollout step {pl_module.rollout_step}; "
                "expected a run recorded from its first step."
            )
        return datamodule

    def _meta(self, trainer: pl.Trainer, pl_module: Any, datamodule: RolloutDataModule) -> dict:
        hparams = pl_module.hparams
        actor_opt, critic_opt = trainer.optimizers
        engine = self._engine
        return {
            "format": FORMAT,
            "recipe": _plain(dict(hparams)),
            "value_target": repr(pl_module.value_target),
            "lag": datamodule.lag,
            "max_staleness": datamodule.max_staleness,
            "prompts_per_step": datamodule.prompts_per_step,
            "samples_per_prompt": datamodule.samples_per_prompt,
            "task": repr(datamodule.task),
            "reward": repr(datamodule.reward),
            "engine": {
                "class": type(engine).__name__,
                "temperature": float(getattr(engine, "temperature", 1.0)),
                "max_new_tokens": getattr(engine, "max_new_tokens", None),
            },
            "seeds": {
                "run": pl_module.seed,
                "data": datamodule.seed,
                "recorder_prompts": self._prompt_seed,
                "recorder_engine_offset": SEED_OFFSET,
            },
            "warm_start": hparams["actor"],
            "actor_optimizer": _optimizer_settings(actor_opt),
            "critic_optimizer": _optimizer_settings(critic_opt),
            "critic_loss_clip": pl_module.critic_loss.clip,
            "max_grad_norm": pl_module.max_grad_norm,
            "ppo_epochs": pl_module.ppo_epochs,
            "num_minibatches": pl_module.num_minibatches,
            "critic_warmup_steps": pl_module.critic_warmup_steps,
            "on_policy_rows": self.on_policy_rows,
            # What models/build.py's build_actor_critic takes to rebuild the initial critic.
            "critic": {
                "actor": hparams["actor"],
                "tiny_hidden_size": hparams["tiny_hidden_size"],
                "tiny_num_layers": hparams["tiny_num_layers"],
                "seed": pl_module.seed,
                "critic_from_actor": hparams["critic_from_actor"],
                "class": f"{type(pl_module.critic).__module__}.{type(pl_module.critic).__name__}",
                "initial_sha256": state_sha256(pl_module.critic),
            },
            "max_tokens_per_micro_batch": hparams["max_tokens_per_micro_batch"],
        }

    # ------------------------------------------------------------------ hooks

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        """π_v: copy the actor's weights (before the step's first optimizer step) into the
        recorder's copy; at the first step build the copy, the engine and ``meta.json``."""
        if self._policy is None:
            datamodule = self._check(trainer, pl_module)
            # After configure_model: the copy attends (packed or not) as the actor does.
            self._policy = copy.deepcopy(pl_module.actor).eval().requires_grad_(False)
            factory = datamodule.engine_factory or EmbeddedEngine
            self._engine = factory(self._policy)
            self._engine.offset_seed(SEED_OFFSET)
            self._prompt_seed = run_seed(None) + SEED_OFFSET if self.seed is None else self.seed
            self._prompts = torch.Generator().manual_seed(self._prompt_seed)
            self.folder.mkdir(parents=True, exist_ok=True)
            meta = self._meta(trainer, pl_module, datamodule)
            (self.folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        with torch.no_grad():
            for mine, theirs in zip(
                self._policy.state_dict().values(),
                pl_module.actor.state_dict().values(),
                strict=True,
            ):
                mine.copy_(theirs)
        self._version = pl_module.policy_version

    @torch.no_grad()
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Save step v: the µ-batch with log π_v, and a fresh on-policy batch of π_v."""
        assert self._policy is not None and self._engine is not None and self._prompts is not None
        step = pl_module.rollout_step - 1  # the module counted the step already
        scorer = pl_module.scorer
        train = batch.to(pl_module.device)
        temperature = float(train.info.get("temperature", 1.0))
        plan = scorer.plan(train.attention_mask, pl_module.ranks.reduce_max)
        target = scorer.score(self._policy, train, plan, temperature)

        engine = self._engine
        engine.update_weights(self._policy.state_dict(), self._version)
        datamodule = trainer.datamodule
        prompts = datamodule.task.sample(self.on_policy_rows, self._prompts)
        fresh = datamodule.collect(
            engine, prompts, group_id_offset=step * self.on_policy_rows, num_samples=1
        ).to(pl_module.device)
        fresh_temperature = float(getattr(engine, "temperature", 1.0))
        fresh_plan = scorer.plan(fresh.attention_mask, pl_module.ranks.reduce_max)
        fresh_target = scorer.score(self._policy, fresh, fresh_plan, fresh_temperature)
        record = {
            "format": FORMAT,
            "rollout_step": step,
            "policy_version": self._version,
            "temperature": temperature,
            "train": _tensors(train, target),
            "on_policy": _tensors(fresh, fresh_target),
        }
        path = self.folder / f"v{step:05d}.pt"
        partial = path.with_suffix(".pt.partial")
        torch.save(record, partial)
        os.replace(partial, path)  # a stopped run leaves whole files only

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
