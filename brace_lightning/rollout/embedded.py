"""The embedded engine: batched KV-cache sampling from an in-process copy of the actor.

Simplifications (this is the default engine for tests, tutorials and small runs; vLLM is the
real-scale engine): a plain Hugging Face forward per decoding step, no continuous batching, no prefix
sharing between the samples of one prompt. A batch decodes until every row has hit a stop token or
``max_new_tokens``; finished rows keep being fed a padding token whose outputs are discarded.

What keeps the per-step overhead down (for a small model on a CPU the decoding loop is bound by it):
the key/value cache and the attention mask of a batch are allocated once, for the prompt width plus
``max_new_tokens``, and each step writes one column into them (growing them by concatenation copied
the whole cache at every step, about 40% of the generation time of the benchmark's model); with SDPA
attention, a decoding step gets its 4-D padding mask as a view instead of the model building a causal
mask; and a token is drawn by inverting the CDF with one uniform per row.

What is recorded per generated token (docs/conventions.md: the log-softmax of the temperature-scaled
logits actually sampled from):

- ``logprobs``: ``log µ(y)`` where µ is the distribution the token was drawn from: softmax of
  ``logits / temperature``, restricted to the top-p nucleus and renormalised when ``top_p < 1``.
  With ``top_p = 1`` this equals :func:`~brace_lightning.models.policy.token_logprobs` at the same
  temperature and weights, up to float error. With ``top_p < 1`` it is the truncated distribution's
  log-prob (≥ the untruncated one), so π/µ also corrects for the truncation.
- ``entropy``: the entropy of that same sampling distribution.
- ``versions``: the policy version of the weights that sampled each token. All tokens of one call
  share it unless ``generate``'s ``on_step`` hook installs new weights mid-call (interruptible
  generation); the key/value cache of the tokens before that point is kept, not recomputed.

``temperature = 0`` means greedy decoding: the sampling distribution is a point mass, so the recorded
log-prob and entropy are 0. Use it for evaluation, not for training data.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from brace_lightning.models.policy import position_ids_from_attention_mask
from brace_lightning.rollout.engine import (
    FinishReason,
    GenerationOutput,
    PromptLimit,
    RolloutEngine,
    Truncation,
    check_generate_args,
    check_sampling_args,
    check_state_dict,
    copy_buckets,
    model_context,
)
from brace_lightning.seeds import run_seed


def _default_stop_ids(model: nn.Module) -> list[int]:
    """The model's eos id(s) from its generation config or config; [] when it has none."""
    eos = None
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(config, "eos_token_id", None)
        if eos is not None:
            break
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


class _PreallocatedLayer(DynamicLayer):
    """A :class:`DynamicLayer` whose keys and values are views of buffers allocated once.

    ``update`` writes the new states after the cached ones and returns the filled prefix, so a
    decoding step costs one column of copying instead of a copy of the whole cache. It holds at most
    ``capacity`` positions, and supports what the engine does with a cache: appending.
    """

    is_croppable = False

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads, _, key_dim = key_states.shape
        self._key_buffer = key_states.new_empty(batch, heads, self.capacity, key_dim)
        self._value_buffer = value_states.new_empty(
            batch, heads, self.capacity, value_states.shape[-1]
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(
                f"EmbeddedEngine's key/value cache holds {self.capacity} positions; a step needed {end}."
            )
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("The engine's preallocated cache only appends.")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("The engine's preallocated cache only appends.")


def _preallocated_cache(model: nn.Module, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``model`` whose full-attention layers hold ``capacity`` positions.

    Layers of other kinds (sliding windows, linear attention) keep the classes the model's config
    asks for.
    """
    cache = DynamicCache(config=model.config)
    if not cache.layers:
        cache.layer_class_to_replicate = partial(_PreallocatedLayer, capacity)
    cache.layers = [
        _PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache


def _decoding_mask_is_padding(model: nn.Module, cache: DynamicCache) -> bool:
    """Whether ``model`` takes a decoding step's 4-D boolean padding mask as its attention mask.

    True for SDPA attention when every layer of ``cache`` is full attention (a sliding window
    would need the model's own mask).
    """
    attention = getattr(model.config, "_attn_implementation", None)
    layers = cache.layers
    return (
        attention == "sdpa" and bool(layers) and all(type(x) is _PreallocatedLayer for x in layers)
    )


class EmbeddedEngine(RolloutEngine):
    """Sample from a private, frozen copy of ``model`` with temperature and top-p.

    Args:
        model: the actor (a Hugging Face causal LM, unwrapped); it is deep-copied, never modified.
        temperature: softmax temperature; 0 means greedy (recorded log-probs and entropy are 0).
        top_p: nucleus size in (0, 1]; 1 disables truncation.
        max_new_tokens: response budget per sample; a row that reaches it ends with ``"length"``.
        stop_token_ids: ids that end a response (included in it as the last action); None means the
            model's eos id(s); ``[]`` disables stopping.
        seed: seed of the engine's ``torch.Generator``; successive calls continue its stream (None:
            the run's ``seed_everything``, see ``brace_lightning.seeds``).
        max_batch_size: decode at most this many samples at once (None = all in one batch).
        device: where the copy lives; None = the device of ``model``'s parameters.
        version: policy version of ``model``'s weights (0 = before the first training step).
        max_prompt_tokens: longest prompt accepted; None = the model's ``max_position_embeddings``
            minus ``max_new_tokens`` (see :class:`~brace_lightning.rollout.engine.PromptLimit`).
        truncation: a longer prompt is refused (``"error"``) or cut to its last
            ``max_prompt_tokens`` tokens and counted (``"left"``, ``data/truncated_prompts``).
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
        max_batch_size: int | None = None,
        device: torch.device | str | None = None,
        version: int = 0,
        max_prompt_tokens: int | None = None,
        truncation: Truncation = "error",
    ) -> None:
        check_sampling_args("EmbeddedEngine", temperature, top_p, max_new_tokens)
        self.prompt_limit = PromptLimit(
            "EmbeddedEngine", max_prompt_tokens, truncation, model_context(model), max_new_tokens
        )
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(
                f"EmbeddedEngine got max_batch_size={max_batch_size}; expected None or an integer >= 1."
            )
        if version < 0:
            raise ValueError(f"EmbeddedEngine got version={version}; expected an integer >= 0.")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_new_tokens = int(max_new_tokens)
        self.max_batch_size = max_batch_size
        self.stop_token_ids = (
            _default_stop_ids(model) if stop_token_ids is None else [int(i) for i in stop_token_ids]
        )
        self._model = copy.deepcopy(model).eval().requires_grad_(False)
        if device is not None:
            self._model.to(device)
        self.device = next(self._model.parameters()).device
        self._vocab_size = self._model.get_input_embeddings().num_embeddings
        self._seed = run_seed(seed)
        self._generator = torch.Generator(device=self.device).manual_seed(self._seed)
        self._version = int(version)

    @property
    def version(self) -> int:
        """Policy version of the weights the engine currently samples with."""
        return self._version

    def state_dict(self) -> dict[str, Any]:
        """The sampling generator's state (weights are republished by the trainer)."""
        return {"generator": self._generator.get_state(), "version": self._version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the sampling stream saved by :meth:`state_dict`."""
        self._generator.set_state(state["generator"])

    def offset_seed(self, offset: int) -> None:
        """Restart the sampling generator at ``seed + offset`` (see :class:`RolloutEngine`)."""
        self._generator.manual_seed(self._seed + int(offset))

    @property
    def model(self) -> nn.Module:
        """The engine's private copy of the actor (eval mode, no gradients)."""
        return self._model

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``weights`` (the actor's full ``state_dict``) into the engine and set ``version``.

        Raises:
            ValueError: when keys are missing or unexpected, a shape differs, or ``version`` < 0.
        """
        if version < 0:
            raise ValueError(f"update_weights got version={version}; expected an integer >= 0.")
        check_state_dict(weights, self._model.state_dict())
        with torch.no_grad():
            self._model.load_state_dict(weights, strict=True)
        self._version = int(version)

    def update_weights_from_buckets(
        self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int
    ) -> None:
        """Copy each bucket of the actor's state dict into the engine as it arrives (no full extra
        copy), then set ``version``; the buckets together must be exactly the full state dict.

        Raises:
            ValueError: for ``version`` < 0, a key that is not the actor's or arrives twice, a shape
                that differs, or keys missing once the stream ends (the tensors received by then
                are already installed, the version is not changed).
        """
        if version < 0:
            raise ValueError(
                f"update_weights_from_buckets got version={version}; expected an integer >= 0."
            )
        copy_buckets(buckets, self._model.state_dict())
        self._version = int(version)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        num_samples: int = 1,
        extra_stop_token_ids: Sequence[int] = (),
        on_step: Callable[[], None] | None = None,
    ) -> GenerationOutput:
        """Sample ``num_samples`` responses per prompt; see :class:`RolloutEngine`.

        ``extra_stop_token_ids`` end responses in this call only, next to ``stop_token_ids``.

        ``on_step`` (optional) is called between decoding steps, after a token was sampled for every
        row and before the next forward. It may call :meth:`update_weights`: the tokens sampled
        afterwards record the new version (interruptible generation), and it may raise to abort.
        """
        check_generate_args(prompts, num_samples, self._vocab_size, extra_stop_token_ids)
        prompts, truncated = self.prompt_limit.apply(prompts)
        stop_ids = [*self.stop_token_ids, *(int(t) for t in extra_stop_token_ids)]
        expanded = [list(p) for p in prompts for _ in range(num_samples)]
        index = [i for i in range(len(prompts)) for _ in range(num_samples)]
        chunk = self.max_batch_size or max(len(expanded), 1)
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        entropy: list[list[float]] = []
        versions: list[list[int]] = []
        finish: list[FinishReason] = []
        for start in range(0, len(expanded), chunk):
            out = self._generate_batch(expanded[start : start + chunk], stop_ids, on_step)
            for tokens, lps, ents, vers, reason in zip(*out, strict=True):
                responses.append(tokens)
                logprobs.append(lps)
                entropy.append(ents)
                versions.append(vers)
                finish.append(reason)
        return GenerationOutput(
            prompt_ids=expanded,
            response_ids=responses,
            logprobs=logprobs,
            versions=versions,
            prompt_index=index,
            finish_reason=finish,
            entropy=entropy,
            truncated_prompts=truncated * num_samples,
        )

    @torch.inference_mode()
    def _generate_batch(
        self,
        prompts: list[list[int]],
        stop_token_ids: list[int],
        on_step: Callable[[], None] | None = None,
    ) -> tuple[
        list[list[int]], list[list[float]], list[list[float]], list[list[int]], list[FinishReason]
    ]:
        """Decode one left-padded batch; ragged tokens, log-probs, entropies, versions, reasons."""
        n, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.zeros(n, width, dtype=torch.long, device=self.device)
        # Every generated column is attended to (finished rows are fed padding whose outputs are
        # discarded), so the mask of step t is the first width + t columns of one preallocated mask.
        full_mask = torch.ones(n, width + self.max_new_tokens, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, device=self.device)
            full_mask[row, : width - len(prompt)] = 0
        attention_mask = full_mask[:, :width]
        position_ids = position_ids_from_attention_mask(attention_mask)
        cache = _preallocated_cache(self._model, width + self.max_new_tokens)
        out = self._model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        # A decoding step's one query sees every cached position that is not padding, so with SDPA
        # and only full-attention layers its mask is a view of one boolean [N, 1, 1, columns] mask,
        # which the model uses as given instead of building a causal mask at every step.
        step_mask: torch.Tensor = full_mask
        if _decoding_mask_is_padding(self._model, cache):
            step_mask = full_mask.bool()[:, None, None, :]
        next_position = position_ids[:, -1:] + 1  # [N, 1]
        stop_ids = torch.tensor(stop_token_ids, dtype=torch.long, device=self.device)
        finished = torch.zeros(n, dtype=torch.bool, device=self.device)
        lengths = torch.full((n,), self.max_new_tokens, dtype=torch.long, device=self.device)
        steps_tokens, steps_logprobs, steps_entropy, steps_version = [], [], [], []
        for step in range(self.max_new_tokens):
            tokens, logp, ent = self._sample(out.logits[:, -1])  # each [N]
            steps_version.append(self._version)
            tokens = torch.where(finished, torch.zeros_like(tokens), tokens)
            steps_tokens.append(tokens)
            steps_logprobs.append(logp)
            steps_entropy.append(ent)
            stopped = ~finished & torch.isin(tokens, stop_ids)
            lengths = torch.where(stopped, torch.full_like(lengths, step + 1), lengths)
            finished |= stopped
            if bool(finished.all()) or step == self.max_new_tokens - 1:
                break
            if on_step is not None:
                on_step()
            out = self._model(
                input_ids=tokens[:, None],
                attention_mask=step_mask[..., : width + step + 1],
                position_ids=next_position,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            next_position = next_position + 1
        token_rows = torch.stack(steps_tokens, dim=1).tolist()  # [N, steps]
        logprob_rows = torch.stack(steps_logprobs, dim=1).tolist()
        entropy_rows = torch.stack(steps_entropy, dim=1).tolist()
        finished_rows = finished.tolist()
        result_tokens, result_logprobs, result_entropy, reasons = [], [], [], []
        result_versions: list[list[int]] = []
        for row, length in enumerate(lengths.tolist()):
            result_tokens.append(token_rows[row][:length])
            result_logprobs.append(logprob_rows[row][:length])
            result_entropy.append(entropy_rows[row][:length])
            result_versions.append(steps_version[:length])
            reasons.append("stop" if finished_rows[row] else "length")
        return result_tokens, result_logprobs, result_entropy, result_versions, reasons

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draw one token per row from ``logits`` ``[N, V]``; returns ``[N]`` tokens, log µ, entropy."""
        if self.temperature == 0:
            tokens = logits.argmax(dim=-1)
            self._require_finite(logits.gather(-1, tokens[:, None]))
            zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=self.device)
            return tokens, zeros, zeros
        scaled = logits.float() / self.temperature
        if self.top_p < 1:
            # Keep the smallest prefix of the sorted distribution whose mass reaches top_p (the top
            # token always stays), then renormalise: that truncated softmax is what is sampled from.
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= self.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
        log_probs = scaled.log_softmax(dim=-1)
        probs = log_probs.exp()
        tokens = self._draw(probs)
        logp = log_probs.gather(-1, tokens[:, None]).squeeze(-1)
        plogp = torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs))
        return tokens, logp, -plogp.sum(dim=-1)

    def _require_finite(self, totals: torch.Tensor) -> None:
        """Refuse to sample from rows whose ``[N, 1]`` summary (CDF end, top logit) is not finite:
        inverse-CDF sampling of a NaN row returns the out-of-range index V."""
        if not bool(torch.isfinite(totals).all()):
            bad = int((~torch.isfinite(totals)).sum())
            raise FloatingPointError(
                f"the embedded engine's next-token distribution is not finite in {bad} of "
                f"{totals.shape[0]} rows at policy version {self.version}; expected finite "
                "logits (the weights it samples with have diverged: lower the actor's learning "
                "rate or set max_grad_norm)."
            )

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One index per row of ``probs`` ``[N, V]``, drawn by inverting the row's CDF.

        ``u`` is uniform on ``(0, total]`` where ``total`` is the row's float64 CDF end, and the
        token is the first index whose CDF reaches ``u``: a zero-probability index shares its CDF
        value with the index before it (or is 0 < u at index 0), so it is never drawn. One uniform
        per row is much cheaper than ``torch.multinomial``, which draws an exponential per entry.
        """
        cdf = probs.double().cumsum(dim=-1)
        self._require_finite(cdf[:, -1:])  # NaN anywhere in a row makes its total NaN
        uniform = torch.rand(
            probs.shape[0], 1, generator=self._generator, dtype=torch.float64, device=self.device
        )
        return torch.searchsorted(cdf, (1 - uniform) * cdf[:, -1:]).squeeze(-1)
