"""From a run to a model you can use: Hugging Face folders from a checkpoint or at the end of ``fit``.

``brace-lightning export --ckpt_path CKPT --out DIR`` writes

- ``DIR/actor``: the policy as a causal LM with its tokenizer (``AutoModelForCausalLM`` /
  ``AutoTokenizer.from_pretrained(DIR/actor)``, servable by vLLM);
- ``DIR/critic``: the critic's backbone (``AutoModel``) plus ``value_head.safetensors``; load it
  with :func:`load_exported_critic`. A run with a critic-free value target (GRPO, Dr. GRPO, RLOO)
  has no critic: only ``DIR/actor`` is written.

A LoRA run's models (``model.lora``, ``models/lora.py``) are written with merged weights under the
base model's names, plain Hugging Face folders like any other. With ``--adapter`` the actor is
written as its base model (``DIR/actor``) plus the adapter in peft's layout (``DIR/actor_adapter``:
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR/actor), DIR/actor_adapter)``);
the critic is merged either way.

``DIR`` must be new or empty unless ``--overwrite`` is given, which replaces it whole. The export is
written into a temporary folder beside ``DIR`` and renamed into place when complete, so a failed
export leaves nothing behind and no file of an earlier export (a stale ``chat_template.jinja``)
becomes part of the new one.

``CKPT`` is a single-process checkpoint file (``*.ckpt``) or the folder of a sharded FSDP2
checkpoint (``ModelParallelStrategy``); a sharded one is read in one process with
``torch.distributed.checkpoint`` into the model's own tensors (the optimizer states are not read).
The checkpoint is read with ``weights_only=True``
(``checkpoints.py``): one whose pickle would run code, or a damaged or foreign file, is refused with
one sentence naming it. The model is rebuilt from the run's saved hyperparameters (``actor`` and the tiny model's sizes),
so a hub actor must be reachable (or in the local cache) to build its skeleton.

:class:`ExportOnFitEnd` does the same at the end of ``fit`` from the live module (gathering
sharded weights on every rank, writing on rank 0); it replaces ``out/actor`` and ``out/critic``
whole and keeps any other file in ``out``::

    trainer:
      callbacks:
        - class_path: brace_lightning.export.ExportOnFitEnd
          init_args: {out: exported}
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel, PreTrainedTokenizerBase

from brace_lightning.checkpoints import LIGHTNING_KEYS, load_checkpoint
from brace_lightning.hparams import from_config
from brace_lightning.models.critic import ValueModel
from brace_lightning.models.lora import (
    LoraSettings,
    add_adapters,
    has_adapters,
    merged_copy,
    merged_critic_copy,
    save_adapter,
)
from brace_lightning.models.policy import load_causal_lm
from brace_lightning.models.sources import TINY, load_actor, load_tokenizer
from brace_lightning.models.weight_sync import (
    DEFAULT_BUCKET_MB,
    MIB,
    gather_state_dict,
    module_bucket_bytes,
)
from brace_lightning.targets import ValueTarget

VALUE_HEAD_FILE = "value_head.safetensors"
#: ``export --adapter``'s folder of the actor's LoRA adapter, beside ``actor`` (its base model).
ADAPTER_FOLDER = "actor_adapter"
#: What ``export`` needs of a checkpoint besides Lightning's keys: the run's hyperparameters.
EXPORT_KEYS = (*LIGHTNING_KEYS, "hyper_parameters")


def _unwrap_hparams(hparams: Any) -> dict[str, Any]:
    return dict(hparams) if hparams is not None else {}


def read_hparams(ckpt_path: str | Path) -> dict[str, Any]:
    """The module's saved hyperparameters of a checkpoint file or sharded checkpoint folder."""
    return _unwrap_hparams(load_checkpoint(ckpt_path, required=EXPORT_KEYS)["hyper_parameters"])


def has_critic(hparams: dict[str, Any]) -> bool:
    """Whether the run of ``hparams`` built a critic (not with a critic-free value target)."""
    value_target = hparams.get("value_target")
    if value_target is None:
        return True
    return from_config(value_target, ValueTarget, "value_target").needs_critic


def build_skeleton(
    hparams: dict[str, Any],
) -> tuple[PreTrainedModel, ValueModel | None, PreTrainedTokenizerBase]:
    """Actor, critic (None for a critic-free run) and tokenizer with the run's architecture
    (random weights, to be filled), with the run's LoRA adapters if it had any (so the
    checkpoint's names fit)."""
    source = hparams.get("actor", TINY)
    tokenizer = load_tokenizer(source)
    if source == TINY:
        actor = load_actor(
            source,
            tokenizer=tokenizer,
            hidden_size=int(hparams.get("tiny_hidden_size", 128)),
            num_layers=int(hparams.get("tiny_num_layers", 2)),
        )
    else:
        actor = load_causal_lm(AutoConfig.from_pretrained(source), seed=0)  # no weights read
    critic = ValueModel.from_config(actor.config, seed=0) if has_critic(hparams) else None
    lora = LoraSettings.coerce(hparams.get("lora"))
    if lora is not None:
        add_adapters(actor, lora, seed=0)
        if lora.critic and critic is not None:
            add_adapters(critic.backbone, lora, seed=0)
    return actor, critic, tokenizer


def _load_model_state(
    ckpt_path: Path, checkpoint: dict[str, Any], target: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Fill ``target`` (``{"actor.…": tensor, "critic.…": tensor}``) from the checkpoint.

    ``checkpoint`` is the file's dictionary (for a sharded folder its ``meta.pt``, whose weights are
    read from the shards).
    """
    if ckpt_path.is_dir():
        from torch.distributed.checkpoint import load as dcp_load

        wrapped = {"state_dict": target}
        with warnings.catch_warnings():
            # no_dist=True is the intent: one process reads every rank's shards.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp_load(wrapped, checkpoint_id=ckpt_path, no_dist=True)
        return wrapped["state_dict"]
    state = checkpoint["state_dict"]
    missing = [key for key in target if key not in state]
    if missing:
        raise ValueError(
            f"ckpt_path={str(ckpt_path)!r} lacks {len(missing)} weights of the rebuilt model "
            f"(e.g. {missing[0]!r}); expected a checkpoint of the same architecture."
        )
    return {key: state[key] for key in target}


def _split(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _new_sibling(target: Path, suffix: str) -> Path:
    """An empty folder beside ``target`` under a fresh hidden name (the umask's permissions, as a
    folder ``export`` made itself)."""
    while True:
        folder = target.with_name(f".{target.name}.{secrets.token_hex(4)}.{suffix}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


@contextlib.contextmanager
def _staged(target: Path) -> Iterator[Path]:
    """A new folder beside ``target`` that replaces ``target`` (folder or file) by rename when the
    block succeeds, and is removed when it fails: ``target`` is never half written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _new_sibling(target, "partial")
    try:
        yield staging
        if not (target.exists() or target.is_symlink()):
            os.rename(staging, target)
            return
        trash = _new_sibling(target, "old")
        try:
            os.rename(target, trash / target.name)
            try:
                os.rename(staging, target)
            except BaseException:
                os.rename(trash / target.name, target)
                raise
        finally:
            shutil.rmtree(trash, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_export_target(out: str | Path, *, overwrite: bool = False) -> Path:
    """``out`` as a Path when ``export`` may write it: new, an empty folder, or ``overwrite``.

    Raises:
        ValueError: ``out`` is a file or a non-empty folder and ``overwrite`` is False.
    """
    out = Path(out)
    if overwrite or not (out.exists() or out.is_symlink()):
        return out
    if not out.is_dir():
        raise ValueError(
            f"out={str(out)!r} is a file; expected a new or empty folder (--overwrite replaces it)."
        )
    if any(out.iterdir()):
        raise ValueError(
            f"out={str(out)!r} is a folder that is not empty; expected a new or empty folder "
            "(--overwrite replaces it whole)."
        )
    return out


def _check_subfolders(out: Path) -> None:
    for name in ("actor", "critic"):
        if (out / name).exists() and not (out / name).is_dir():
            raise ValueError(
                f"out={str(out)!r} holds a file named {name}; expected a folder there (or none)."
            )


def save_hf_folders(
    actor: nn.Module,
    critic: ValueModel | None,
    tokenizer: PreTrainedTokenizerBase,
    out: str | Path,
    *,
    actor_state: dict[str, torch.Tensor] | None = None,
    critic_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``out/actor`` (model + tokenizer) and ``out/critic`` (backbone + value head; not
    written when ``critic`` is None).

    Each replaces an earlier folder of its name whole (written beside it, then renamed), so no file
    of an earlier export stays; other files in ``out`` are kept. ``actor_state``/``critic_state``
    (full tensors) replace the modules' own state when given (for sharded modules, whose
    ``state_dict`` holds shards).

    Raises:
        ValueError: the actor is not a transformers model, or ``out/actor`` or ``out/critic`` is a
            file.
    """
    out = Path(out)
    if not isinstance(actor, PreTrainedModel):
        raise ValueError(
            f"export needs a transformers PreTrainedModel actor; got {type(actor).__name__}."
        )
    _check_subfolders(out)
    with _staged(out / "actor") as actor_dir:
        actor.save_pretrained(actor_dir, state_dict=actor_state, safe_serialization=True)
        tokenizer.save_pretrained(actor_dir)
    if critic is None:
        return out
    critic_state = critic.state_dict() if critic_state is None else critic_state
    backbone = {
        k[len("backbone.") :]: v for k, v in critic_state.items() if k.startswith("backbone.")
    }
    head = {
        k[len("value_head.") :]: v.contiguous()
        for k, v in critic_state.items()
        if k.startswith("value_head.")
    }
    with _staged(out / "critic") as critic_dir:
        critic.backbone.save_pretrained(critic_dir, state_dict=backbone, safe_serialization=True)
        save_file(head, str(critic_dir / VALUE_HEAD_FILE))
        tokenizer.save_pretrained(critic_dir)
        (critic_dir / "brace_lightning.json").write_text(
            json.dumps({"kind": "ValueModel", "value_head": VALUE_HEAD_FILE}, indent=2) + "\n"
        )
    return out


def export_checkpoint(
    ckpt_path: str | Path, out: str | Path, *, overwrite: bool = False, adapter: bool = False
) -> Path:
    """Export a checkpoint (file or sharded folder) to Hugging Face folders; returns ``out``.

    ``out`` must be new or an empty folder unless ``overwrite``, which replaces it whole; it appears
    only when the export is complete (written beside it, then renamed). A LoRA run's models are
    merged; ``adapter`` writes its actor as base model plus adapter folder (module docstring).

    Raises:
        ValueError: one sentence for a target it may not write, or a checkpoint that is missing,
            damaged, foreign, asks to run code or does not fit the rebuilt model.
    """
    path = Path(ckpt_path)
    out = check_export_target(out, overwrite=overwrite)
    checkpoint = load_checkpoint(path, required=EXPORT_KEYS)
    hparams = _unwrap_hparams(checkpoint["hyper_parameters"])
    lora = LoraSettings.coerce(hparams.get("lora"))
    if adapter and lora is None:
        raise ValueError(
            f"adapter=True needs the checkpoint of a LoRA run (model.lora set); "
            f"ckpt_path={str(path)!r} has none."
        )
    actor, critic, tokenizer = build_skeleton(hparams)
    target = {f"actor.{k}": v for k, v in actor.state_dict().items()}
    if critic is not None:
        target |= {f"critic.{k}": v for k, v in critic.state_dict().items()}
    state = _load_model_state(path, checkpoint, target)
    actor.load_state_dict(_split(state, "actor."))
    if critic is not None:
        critic.load_state_dict(_split(state, "critic."))
    with _staged(out) as staging:
        if lora is None:
            save_hf_folders(actor, critic, tokenizer, staging)
        else:
            plain = merged_copy(actor, adapters=not adapter)
            save_hf_folders(plain, merged_critic_copy(critic), tokenizer, staging)
        if adapter:
            assert lora is not None
            source = hparams.get("actor", TINY)
            base = None if source == TINY else str(source)
            save_adapter(actor, lora, staging / ADAPTER_FOLDER, base_model=base)
    return out


def load_exported_critic(folder: str | Path, **kwargs: Any) -> ValueModel:
    """The critic of ``export``'s ``DIR/critic`` folder (``kwargs`` go to ``AutoModel``)."""
    folder = Path(folder)
    if not (folder / VALUE_HEAD_FILE).is_file():
        raise ValueError(
            f"folder={str(folder)!r} has no {VALUE_HEAD_FILE}; expected the critic folder that "
            "`brace-lightning export` writes."
        )
    critic = ValueModel(AutoModel.from_pretrained(folder, **kwargs))
    critic.value_head.load_state_dict(load_file(str(folder / VALUE_HEAD_FILE)))
    return critic


class ExportOnFitEnd(pl.Callback):
    """Export the trained actor and critic as Hugging Face folders when ``fit`` ends.

    Args:
        out: the output folder (``out/actor``, ``out/critic``); relative paths are taken from the
            working directory.
    """

    def __init__(self, out: str = "exported") -> None:
        if not out:
            raise ValueError(f"ExportOnFitEnd got out={out!r}; expected a folder path.")
        self.out = out

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse an ``out`` whose ``actor`` or ``critic`` is a file before training, not after."""
        _check_subfolders(Path(self.out))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        actor, critic = pl_module.actor, pl_module.critic  # type: ignore[attr-defined]
        if has_adapters(actor) or has_adapters(critic):  # LoRA: never sharded, written merged
            actor, critic = merged_copy(actor), merged_critic_copy(critic)
        # Collectives: gathered on global rank 0 only, bucket by bucket; the other ranks hold at
        # most their part of one bucket (models/weight_sync.py).
        bucket_bytes = module_bucket_bytes(pl_module) or DEFAULT_BUCKET_MB * MIB
        actor_state = gather_state_dict(actor, bucket_bytes=bucket_bytes, dst=0)
        critic_state = None
        if critic is not None:
            critic_state = gather_state_dict(critic, bucket_bytes=bucket_bytes, dst=0)
        if trainer.is_global_zero:
            assert actor_state is not None and (critic is None or critic_state is not None)
            save_hf_folders(
                actor,
                critic,
                pl_module.tokenizer,  # type: ignore[attr-defined]
                self.out,
                actor_state=actor_state,
                critic_state=critic_state,
            )
        trainer.strategy.barrier("export")


def main(args: list[str] | None = None) -> None:
    """``brace-lightning export --ckpt_path CKPT --out DIR [--overwrite] [--adapter]``."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        prog="brace-lightning export",
        description="Write a checkpoint's actor (with tokenizer) and critic as Hugging Face folders.",
    )
    parser.add_argument(
        "--ckpt_path", type=str, required=True, help="a .ckpt file or sharded folder"
    )
    parser.add_argument(
        "--out", type=str, required=True, help="output folder (actor/, critic/), new or empty"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out whole if it exists")
    parser.add_argument(
        "--adapter",
        action="store_true",
        help=f"a LoRA run's actor as base model (actor/) plus adapter ({ADAPTER_FOLDER}/)",
    )
    config = parser.parse_args(args)
    try:
        out = export_checkpoint(
            config.ckpt_path, config.out, overwrite=config.overwrite, adapter=config.adapter
        )
    except ValueError as error:
        parser.error(str(error))
    adapter = f" (adapter: {out}/{ADAPTER_FOLDER})" if config.adapter else ""
    print(f"exported {config.ckpt_path} to {out}/actor and {out}/critic{adapter}")
