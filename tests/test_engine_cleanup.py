"""Nothing an engine started is left behind after a failure (issue 34, item 3).

Before: the synchronous data module had no ``on_exception``, so after an error in ``fit`` its
engine was never closed (a launched vLLM server and its engine processes outlived the trainer, the
engine's model and weight copies stayed in the temporary folder); a ``VLLMServerEngine`` whose
constructor failed left its server running and its folders behind. Tested with stand-ins for the
vLLM server and library, so these run without vLLM.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import brace_lightning.rollout.vllm as vllm_module
import brace_lightning.rollout.vllm_server as server_module
from brace_lightning.cli import run
from brace_lightning.data import RolloutDataModule
from brace_lightning.models.sources import load_actor, load_tokenizer
from brace_lightning.rollout.embedded import EmbeddedEngine
from brace_lightning.rollout.vllm_server import VLLMServer, VLLMServerEngine, VLLMServerError
from brace_lightning.tasks import ArithmeticReward, ArithmeticTask
from tests.test_trainer import small_run

#: Engines of :class:`FailingEngine` closed so far (their ids).
CLOSED: list[int] = []


class FailingEngine(EmbeddedEngine):
    """An embedded engine whose generation fails, recording its ``close``."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the engine failed")

    def close(self) -> None:
        CLOSED.append(id(self))


class RecordingEngine:
    """A stand-in engine that records ``close``."""

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def actor():
    tokenizer = load_tokenizer("tiny-char")
    return load_actor("tiny-char", tokenizer=tokenizer, hidden_size=32, num_layers=1, seed=0)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """``tempfile.mkdtemp`` makes its folders here, so a test sees what is left behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_on_exception_closes_the_engine_and_drops_it():
    datamodule = RolloutDataModule(task=ArithmeticTask(), reward=ArithmeticReward())
    engine = RecordingEngine()
    datamodule.engine = engine  # type: ignore[assignment]
    datamodule.on_exception(RuntimeError("boom"))
    assert engine.closed == 1 and datamodule.engine is None
    datamodule.on_exception(RuntimeError("again"))  # nothing left to close
    assert engine.closed == 1


def test_a_failing_fit_closes_the_sync_engine(tmp_path):
    CLOSED.clear()
    args = small_run(tmp_path, f"--data.engine.class_path={__name__}.FailingEngine")
    with pytest.raises(RuntimeError, match="the engine failed"):
        run(args)
    assert len(CLOSED) == 1


class StandInServer:
    """Records ``stop``; its URL answers nothing (a server that never became usable)."""

    started: list[StandInServer] = []

    def __init__(self, model_dir: str, **kwargs: Any) -> None:
        self.model_dir = Path(model_dir)
        self.url = f"http://127.0.0.1:{server_module.free_port()}"
        self.api_key = "stand-in-secret"
        self.stopped = 0
        StandInServer.started.append(self)

    @property
    def alive(self) -> bool:
        return not self.stopped

    def stop(self) -> None:
        self.stopped += 1


def test_a_failed_server_engine_constructor_stops_its_server_and_deletes_its_folders(
    actor, private_tmp, monkeypatch
):
    StandInServer.started.clear()
    monkeypatch.setattr(server_module, "VLLMServer", StandInServer)
    with pytest.raises(VLLMServerError, match="is unreachable"):
        VLLMServerEngine(actor, request_timeout=2)
    (server,) = StandInServer.started
    assert server.stopped == 1
    assert server.model_dir.parent == private_tmp and not server.model_dir.exists()
    assert list(private_tmp.iterdir()) == []  # the weights folder too


def _engine_without_servers(monkeypatch: pytest.MonkeyPatch, actor: Any) -> VLLMServerEngine:
    monkeypatch.setattr(VLLMServerEngine, "_served_model", lambda self, url: "model")
    monkeypatch.setattr(VLLMServerEngine, "_post", lambda self, url, path, body=None: None)
    return VLLMServerEngine(actor, urls=["http://127.0.0.1:1"])


def test_server_engine_folders_go_with_close_or_garbage_collection(actor, private_tmp, monkeypatch):
    engine = _engine_without_servers(monkeypatch, actor)
    assert engine.weights_dir.is_dir()
    engine.close()
    engine.close()  # a second close does nothing
    assert list(private_tmp.iterdir()) == []
    engine = _engine_without_servers(monkeypatch, actor)
    assert engine.weights_dir.is_dir()
    del engine
    gc.collect()
    assert list(private_tmp.iterdir()) == []


def test_server_engine_folders_go_at_interpreter_exit(tmp_path):
    script = f"""
import tempfile
tempfile.tempdir = {str(tmp_path)!r}
from brace_lightning.models.sources import load_actor, load_tokenizer
from brace_lightning.rollout.vllm_server import VLLMServerEngine
VLLMServerEngine._served_model = lambda self, url: "model"
VLLMServerEngine._post = lambda self, url, path, body=None: None
actor = load_actor("tiny-char", tokenizer=load_tokenizer("tiny-char"), hidden_size=32, num_layers=1)
ENGINE = VLLMServerEngine(actor, urls=["http://127.0.0.1:1"])  # a global: no GC before the exit
assert ENGINE.weights_dir.is_dir()
print("made", ENGINE.weights_dir)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "made" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_server_whose_start_is_interrupted_is_stopped(tmp_path, monkeypatch):
    stopped: list[int] = []

    def interrupted(self: VLLMServer, timeout: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(server_module.subprocess, "Popen", lambda *a, **k: SimpleNamespace(pid=0))
    monkeypatch.setattr(VLLMServer, "_wait_ready", interrupted)
    monkeypatch.setattr(VLLMServer, "stop", lambda self: stopped.append(1))
    with pytest.raises(KeyboardInterrupt):
        VLLMServer(tmp_path, port=1, log_path=tmp_path / "log")
    assert stopped == [1]


def test_a_failed_vllm_engine_constructor_deletes_its_model_copy(actor, private_tmp, monkeypatch):
    def refuse(**kwargs: Any) -> None:
        assert Path(kwargs["model"]).is_dir()  # the copy was made
        raise RuntimeError("no GPU memory left")

    fake = SimpleNamespace(LLM=refuse, envs=SimpleNamespace(VLLM_ENABLE_V1_MULTIPROCESSING=True))
    monkeypatch.setattr(vllm_module, "import_vllm", lambda: fake)
    with pytest.raises(RuntimeError, match="no GPU memory left"):
        vllm_module.VLLMEngine(actor)
    assert list(private_tmp.iterdir()) == []
