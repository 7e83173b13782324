"""Reading a checkpoint without running code from it, and refusing a file that is not one in one sentence.

A ``.ckpt`` file is a zip archive whose ``data.pkl`` is a pickle, and unpickling may call any
function the pickle names: ``torch.load(weights_only=False)`` of a hostile file runs its shell
command before anything else happens. A brace_lightning checkpoint holds only tensors and plain data
(``hparams.py``, ``rollout/buffer.py`` and ``seeds.py`` keep it so), so every checkpoint is read
here with ``weights_only=True``, whose unpickler refuses every other global before calling it.

:func:`load_checkpoint` returns the checkpoint's dictionary or raises one ValueError sentence that
names the file and what was expected: a pickle that asks for a function (the function's name; it was
not called), a file that is not a zip archive (random bytes), a damaged or truncated archive, an
archive without ``data.pkl`` (a zip that ``torch.save`` did not write) and a dictionary without
Lightning's keys. The sentence never suggests ``weights_only=False``: a checkpoint that needs it is
not one this program wrote. :func:`check_ckpt_path` is the check ``fit`` and ``validate`` run on
``--ckpt_path`` before Lightning reads the file (Lightning's own error for these files is a
traceback that does not name the file, or, for random bytes, torch's advice to weaken
``weights_only``).

A sharded checkpoint (``ModelParallelStrategy``, FSDP2) is a folder: everything but the tensors is
in ``meta.pt``, read as above; the tensors are ``torch.distributed.checkpoint`` shards, whose index
``.metadata`` that library reads with plain ``pickle.load``. So the index is unpickled here first
with only the globals such an index holds (the library's own metadata classes, dtypes, ``torch.Size``,
paths); any other global is refused before it is called.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: Lightning's metadata file inside a sharded checkpoint folder.
META_FILE = "meta.pt"
#: ``torch.distributed.checkpoint``'s index of the shards (a plain pickle).
SHARD_INDEX_FILE = ".metadata"
#: Keys every Lightning checkpoint file has (a sharded folder's ``meta.pt`` has no ``state_dict``).
LIGHTNING_KEYS: tuple[str, ...] = ("pytorch-lightning_version", "state_dict")
#: ``ckpt_path`` values Lightning resolves itself (``fit``/``validate``): not file names.
SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")

_ZIP_MAGIC = b"PK\x03\x04"
_UNSAFE_GLOBAL = re.compile(r"unsupported (?:global: )?GLOBAL ([\w.]+)", re.IGNORECASE)
_EXPECTED = "expected a Lightning checkpoint written by brace-lightning"


def _describe(path: Path) -> str:
    return f"ckpt_path={str(path)!r}"


def _unreadable(path: Path) -> str | None:
    """What is wrong with the archive at ``path`` (torch's own message is not shown: it advises
    ``weights_only=False``), or None when it looks like a torch archive."""
    with open(path, "rb") as file:
        head = file.read(len(_ZIP_MAGIC))
    if head != _ZIP_MAGIC:
        return "is not a zip archive as torch.save writes (random bytes or another format)"
    if not zipfile.is_zipfile(path):
        return "is a damaged or truncated zip archive"
    with zipfile.ZipFile(path) as archive:
        if not any(name.endswith("/data.pkl") for name in archive.namelist()):
            return "is a zip archive without data.pkl, so not one torch.save wrote"
    return None


def _read(file: Path, shown: Path) -> Any:
    """``torch.load(file, weights_only=True)``; ValueError naming ``shown`` when it fails."""
    where = _describe(shown) + ("" if file == shown else f" ({file.name})")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        reason = _unreadable(file)
        if reason is None:
            unsafe = _UNSAFE_GLOBAL.search(str(error))
            asks = f"to call {unsafe.group(1)}" if unsafe else "for objects other than plain data"
            raise ValueError(
                f"{where} was refused: its pickle asks {asks}, which a checkpoint of tensors and "
                f"plain data never needs, and nothing in it was run; {_EXPECTED}."
            ) from None
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as error:
        reason = _unreadable(file) or f"is a damaged torch archive ({type(error).__name__})"
    raise ValueError(f"{where} {reason}; {_EXPECTED}.")


class _ShardIndexUnpickler(pickle.Unpickler):
    """Unpickles a shard index, finding only the globals ``torch.distributed.checkpoint`` writes."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return found

    @staticmethod
    def _allowed(module: str, name: str) -> bool:
        if module.startswith("torch.distributed.checkpoint."):
            return isinstance(getattr(__import__(module, fromlist=[name]), name, None), type)
        if module == "torch":
            return isinstance(getattr(torch, name, None), torch.dtype) or name == "Size"
        return (module, name) in {
            ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"),
            ("collections", "OrderedDict"),
        }


def _check_shard_index(folder: Path) -> None:
    """Unpickle ``folder/.metadata`` with :class:`_ShardIndexUnpickler`; ValueError naming it."""
    file = folder / SHARD_INDEX_FILE
    where = f"{_describe(folder)} ({SHARD_INDEX_FILE})"
    if not file.is_file():
        raise ValueError(
            f"{_describe(folder)} has {META_FILE} but no {SHARD_INDEX_FILE}; expected a sharded "
            "checkpoint folder written by ModelParallelStrategy, whole."
        )
    try:
        _ShardIndexUnpickler(io.BytesIO(file.read_bytes())).load()
    except pickle.UnpicklingError as error:
        unsafe = _UNSAFE_GLOBAL.search(str(error))
        if unsafe is None:
            raise ValueError(f"{where} is damaged; {_EXPECTED}.") from None
        raise ValueError(
            f"{where} was refused: its pickle asks to call {unsafe.group(1)}, which a shard index "
            f"never needs, and nothing in it was run; {_EXPECTED}."
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError):
        raise ValueError(f"{where} is damaged; {_EXPECTED}.") from None


def load_checkpoint(
    ckpt_path: str | Path, *, required: Sequence[str] = LIGHTNING_KEYS
) -> dict[str, Any]:
    """A checkpoint's dictionary, read with ``weights_only=True`` (tensors memory-mapped).

    Args:
        ckpt_path: a ``.ckpt`` file, or a sharded checkpoint folder (its ``meta.pt`` is read; the
            shards are left to ``torch.distributed.checkpoint``).
        required: keys the dictionary must have (for a folder, ``state_dict`` is not asked for:
            it lives in the shards).

    Raises:
        ValueError: one sentence naming the file: missing, not a checkpoint, damaged, foreign, or
            asking to run code.
    """
    path = Path(ckpt_path)
    if path.is_dir():
        file = path / META_FILE
        if not file.is_file():
            raise ValueError(
                f"{_describe(path)} is a folder without {META_FILE}; expected a sharded "
                "checkpoint folder written by ModelParallelStrategy."
            )
        required = [key for key in required if key != "state_dict"]
        _check_shard_index(path)
    elif path.is_file():
        file = path
    else:
        raise ValueError(
            f"{_describe(path)} does not exist; expected a .ckpt file or a sharded checkpoint "
            "folder."
        )
    checkpoint = _read(file, path)
    if not isinstance(checkpoint, dict):
        raise ValueError(
            f"{_describe(path)} holds a {type(checkpoint).__name__}, not a dictionary; {_EXPECTED}."
        )
    missing = [key for key in required if key not in checkpoint]
    if missing:
        keys = [repr(key) for key in missing]
        listed = " and ".join([", ".join(keys[:-1]), keys[-1]] if len(keys) > 1 else keys)
        raise ValueError(f"{_describe(path)} lacks {listed}; {_EXPECTED}.")
    return checkpoint


def is_special_ckpt_path(ckpt_path: str) -> bool:
    """Whether Lightning resolves ``ckpt_path`` itself (``last``, ``registry:name``, a URL)."""
    name = ckpt_path.lower()
    return name in SPECIAL_CKPT_PATHS or name.startswith("registry:") or "://" in ckpt_path


def check_ckpt_path(ckpt_path: str | Path | None) -> None:
    """Refuse ``fit``/``validate``'s ``--ckpt_path`` with one sentence unless it is a readable
    Lightning checkpoint (see :func:`load_checkpoint`); None and Lightning's special values pass."""
    if ckpt_path is None or is_special_ckpt_path(str(ckpt_path)):
        return
    load_checkpoint(ckpt_path)
