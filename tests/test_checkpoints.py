"""Checkpoints are read without running code from them, and a file that is not one is refused in one
sentence naming it, by ``fit --ckpt_path`` and ``validate --ckpt_path`` (``export``: test_export.py).

Before, a pickle that runs code was run by ``export`` (``weights_only=False``), and a damaged or
foreign file ended ``fit`` in a traceback that did not name the file, or, for random bytes, in
torch's advice to load it with ``weights_only=False``.
"""

from __future__ import annotations

import os
import pickle
import random
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from brace_lightning.checkpoints import check_ckpt_path, load_checkpoint
from brace_lightning.cli import run
from tests.test_trainer import small_run

EXPECTED = "expected a Lightning checkpoint written by brace-lightning."


class RunsCode:
    """Unpickling this calls ``os.system`` to create ``marker`` (what a hostile checkpoint does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def hostile(folder: Path) -> tuple[Path, Path]:
    """A checkpoint with Lightning's keys whose pickle would create a marker file; (file, marker)."""
    marker = folder / "code_ran"
    path = folder / "hostile.ckpt"
    torch.save(
        {
            "pytorch-lightning_version": "2.6.0",
            "state_dict": {},
            "hyper_parameters": {"actor": "tiny-char", "note": RunsCode(marker)},
        },
        path,
    )
    return path, marker


def random_bytes(folder: Path) -> Path:
    path = folder / "random.ckpt"
    path.write_bytes(random.Random(0).randbytes(4096))
    return path


def truncated(folder: Path) -> Path:
    whole = folder / "whole.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {"w": torch.ones(4096)}}, whole)
    path = folder / "truncated.ckpt"
    path.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    return path


def plain_zip(folder: Path) -> Path:
    path = folder / "plain_zip.ckpt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes/readme.txt", "not a checkpoint")
    return path


def foreign(folder: Path) -> Path:
    """A torch archive without Lightning's keys (a bare state dict)."""
    path = folder / "foreign.ckpt"
    torch.save({"weight": torch.ones(2)}, path)
    return path


#: Each bad file and the sentence it is refused with (after ``ckpt_path='<file>' ``).
BAD_FILES: list[tuple[Callable[[Path], Path], str]] = [
    (
        lambda folder: hostile(folder)[0],
        f"was refused: its pickle asks to call {os.system.__module__}.system, which a checkpoint of tensors and "
        f"plain data never needs, and nothing in it was run; {EXPECTED}",
    ),
    (
        random_bytes,
        f"is not a zip archive as torch.save writes (random bytes or another format); {EXPECTED}",
    ),
    (truncated, f"is a damaged or truncated zip archive; {EXPECTED}"),
    (plain_zip, f"is a zip archive without data.pkl, so not one torch.save wrote; {EXPECTED}"),
    (foreign, f"lacks 'pytorch-lightning_version' and 'state_dict'; {EXPECTED}"),
]
BAD_IDS = ["runs-code", "random-bytes", "truncated", "plain-zip", "foreign-keys"]


@pytest.mark.parametrize(("make", "sentence"), BAD_FILES, ids=BAD_IDS)
def test_load_checkpoint_refuses_bad_files_with_one_sentence(tmp_path, make, sentence):
    path = make(tmp_path)
    with pytest.raises(ValueError) as info:
        load_checkpoint(path)
    assert str(info.value) == f"ckpt_path={str(path)!r} {sentence}"
    assert "weights_only" not in str(info.value)
    assert not (tmp_path / "code_ran").exists()


def test_a_checkpoint_that_runs_code_is_not_run(tmp_path):
    path, marker = hostile(tmp_path)
    with pytest.raises(ValueError, match="nothing in it was run"):
        check_ckpt_path(path)
    assert not marker.exists()


def test_lightnings_own_names_for_checkpoints_are_left_to_lightning(tmp_path):
    for name in ("last", "best", "hpc", "registry", "registry:my-model", "s3://bucket/x.ckpt"):
        check_ckpt_path(name)  # no file of that name here: Lightning resolves these
    check_ckpt_path(None)
    with pytest.raises(ValueError, match=r"does not exist; expected a \.ckpt file"):
        check_ckpt_path(tmp_path / "last")  # a path, not the keyword


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
@pytest.mark.parametrize(("make", "sentence"), BAD_FILES, ids=BAD_IDS)
def test_fit_and_validate_refuse_a_bad_ckpt_path_with_one_sentence(
    tmp_path, capsys, subcommand, make, sentence
):
    path = make(tmp_path)
    args = small_run(tmp_path, f"--ckpt_path={path}")
    args[0] = subcommand
    with pytest.raises(SystemExit) as info:
        run(args)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.strip().splitlines()[-1] == f"error: ckpt_path={str(path)!r} {sentence}"
    assert "Traceback" not in err and "weights_only" not in err
    assert not (tmp_path / "code_ran").exists()


def test_a_sharded_folder_without_its_metadata_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match=r"is a folder without meta\.pt; expected a sharded"):
        load_checkpoint(tmp_path / "ckpt")
    path = sharded(tmp_path)
    (path / "meta.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"'.*sharded' \(meta\.pt\) is not a zip archive"):
        load_checkpoint(path)


def sharded(folder: Path) -> Path:
    """A sharded checkpoint folder as ModelParallelStrategy writes it: shards, their index
    ``.metadata`` (a plain pickle) and ``meta.pt``."""
    import warnings

    from torch.distributed.checkpoint import save

    path = folder / "sharded"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: one process writes every shard
        save(
            {"state_dict": {"w": torch.ones(3, 2), "h": torch.zeros(2, dtype=torch.bfloat16)}},
            checkpoint_id=path,
            no_dist=True,
        )
    torch.save({"pytorch-lightning_version": "2.6.0", "hyper_parameters": {}}, path / "meta.pt")
    return path


def test_a_sharded_folder_whose_shard_index_runs_code_is_refused_unrun(tmp_path):
    """torch.distributed.checkpoint reads ``.metadata`` with plain pickle.load."""
    path = sharded(tmp_path)
    assert load_checkpoint(path)["pytorch-lightning_version"] == "2.6.0"
    marker = tmp_path / "code_ran"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(ValueError) as info:
        check_ckpt_path(path)
    assert str(info.value) == (
        f"ckpt_path={str(path)!r} (.metadata) was refused: its pickle asks to call "
        f"{os.system.__module__}.system, which a shard index never needs, and nothing in it was "
        f"run; {EXPECTED}"
    )
    assert not marker.exists()
    (path / ".metadata").unlink()
    with pytest.raises(ValueError, match=r"has meta\.pt but no \.metadata; expected a sharded"):
        load_checkpoint(path)
