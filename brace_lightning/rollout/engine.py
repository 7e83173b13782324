"""The rollout-engine interface: generate tokens with per-token behavior log-probs and versions.

An engine holds a copy of the actor's weights (possibly stale) and samples responses from it. For
every generated token it records ``log µ(token)`` — the log-prob under the distribution it actually
sampled from (temperature-scaled, top-p truncated and renormalised) — and the policy version whose
weights sampled it. ``update_weights`` installs newer actor weights and the version they carry.

Outputs are plain Python lists (ragged, one entry per sample) so that engines backed by other
processes (vLLM) produce them without a tensor round trip; ``rollout/collect.py`` pads them into a
:class:`~brace_lightning.rollout.types.RolloutBatch`.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

FinishReason = Literal["stop", "length"]
Truncation = Literal["left", "error"]


@dataclass
class GenerationOutput:
    """Ragged generation results, one entry per sample, prompt-major order.

    With ``N`` prompts and ``num_samples = S``, sample ``i`` comes from prompt ``i // S``; there are
    ``N * S`` entries in every list. Per-token lists have the length of that sample's response.

    Args:
        prompt_ids: the prompt's token ids (unpadded).
        response_ids: generated token ids; a stop token, when hit, is the last one (it is an action).
        logprobs: behavior log-prob of each response token under the sampling distribution.
        versions: policy version that sampled each response token.
        prompt_index: index of the prompt (in the ``prompts`` argument) the sample answers.
        finish_reason: ``"stop"`` (a stop token was generated) or ``"length"`` (hit the budget).
        entropy: entropy of the sampling distribution at each response token, or None.
        action_mask: per response token, True where the policy generated it (an action) and False
            at environment tokens (tool observations of a multi-turn episode); None means every
            response token is an action (single-turn generation). Engines leave it None; the
            multi-turn loop (``rollout/multiturn.py``) fills it.
        truncated_prompts: prompts of this call the engine cut to ``max_prompt_tokens``
            (``truncation="left"``); ``prompt_ids`` hold the cut prompts, which is what the trainer
            then scores.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    prompt_index: list[int]
    finish_reason: list[FinishReason]
    entropy: list[list[float]] | None = None
    action_mask: list[list[bool]] | None = None
    truncated_prompts: int = 0

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        for name in ("prompt_ids", "logprobs", "versions", "prompt_index", "finish_reason"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"GenerationOutput.{name} has {len(getattr(self, name))} entries; expected {n} "
                    "like response_ids."
                )
        per_token = ["logprobs", "versions"]
        per_token += [
            name for name in ("entropy", "action_mask") if getattr(self, name) is not None
        ]
        for name in ("entropy", "action_mask"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(
                    f"GenerationOutput.{name} has {len(getattr(self, name))} entries; expected {n} "
                    "like response_ids."
                )
        for name in per_token:
            for i, (values, tokens) in enumerate(
                zip(getattr(self, name), self.response_ids, strict=True)
            ):
                if len(values) != len(tokens):
                    raise ValueError(
                        f"GenerationOutput.{name}[{i}] has {len(values)} values; expected "
                        f"{len(tokens)}, one per response token."
                    )

    def __len__(self) -> int:
        return len(self.response_ids)


class RolloutEngine(ABC):
    """Base class of rollout engines (embedded torch engine, vLLM engine)."""

    @property
    @abstractmethod
    def version(self) -> int:
        """Policy version of the weights the engine currently samples with."""

    @abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        *,
        num_samples: int = 1,
        extra_stop_token_ids: Sequence[int] = (),
    ) -> GenerationOutput:
        """Sample ``num_samples`` responses for each prompt.

        Args:
            prompts: token ids of each prompt (unpadded, non-empty).
            num_samples: responses per prompt (the group size for group-relative baselines).
            extra_stop_token_ids: token ids that also end a response in this call, in addition to
                the engine's own stop ids (eos); a response that hits one ends with it (included,
                as the last token) and has finish reason ``"stop"``. The multi-turn loop passes the
                last token of each tool-call closing string here (e.g. ``>`` of ``</calc>``). An
                engine that predates this keyword still works with the loop, which then cuts
                responses at the closing string itself (same distribution, more tokens decoded).

        Returns:
            A :class:`GenerationOutput` with ``len(prompts) * num_samples`` entries, prompt-major.
        """

    @abstractmethod
    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Install the actor's weights (a full state dict) as policy ``version``.

        The tensors belong to the caller and may be overwritten with another version once this
        returns (producers reuse their weight slots): copy what the engine keeps.
        """

    def update_weights_from_buckets(
        self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int
    ) -> None:
        """Install the actor's weights arriving as a stream of buckets (disjoint parts of the full
        state dict, ``models/weight_sync.py``) as policy ``version``.

        The default collects the buckets into one dict and calls :meth:`update_weights`; an
        engine that can load a part at a time overrides it (the embedded engine copies each bucket
        into its model as it arrives, so no full extra copy is held).
        """
        weights: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            weights.update(bucket)
        self.update_weights(weights, version)

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for in-process engines
        """Release resources (processes, servers); the default does nothing."""

    #: Softmax temperature of the sampling distribution; the trainer recomputes log π with it.
    temperature: float = 1.0

    def state_dict(self) -> dict[str, Any]:
        """Resumable state (sampling RNG); weights are not included, the trainer republishes them."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless default
        """Restore what :meth:`state_dict` returned."""

    def offset_seed(self, offset: int) -> None:  # noqa: B027 - engines without a seed ignore it
        """Restart the sampling stream at ``seed + offset``.

        Data-parallel rank r calls it with r, so that ranks do not share their sampling noise (their
        engines are built from the same recipe, hence the same seed). Engines without a seed ignore
        it.
        """


def accepts_extra_stops(engine: RolloutEngine) -> bool:
    """Whether ``engine.generate`` takes the ``extra_stop_token_ids`` keyword."""
    return "extra_stop_token_ids" in inspect.signature(engine.generate).parameters


def check_sampling_args(name: str, temperature: float, top_p: float, max_new_tokens: int) -> None:
    """Raise one sentence for a negative temperature, top_p outside (0, 1] or a budget < 1."""
    if not temperature >= 0:
        raise ValueError(f"{name} got temperature={temperature}; expected a value >= 0.")
    if not 0 < top_p <= 1:
        raise ValueError(f"{name} got top_p={top_p}; expected a value in (0, 1].")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{name} got max_new_tokens={max_new_tokens}; expected an integer >= 1.")


class PromptLimit:
    """``max_prompt_tokens`` and ``truncation`` of an engine: what to do with a prompt that does
    not fit the model's context.

    Args:
        name: the engine's class name (in errors).
        max_prompt_tokens: longest prompt accepted; None means the model's context
            (``context``, e.g. ``max_position_embeddings``) minus ``max_new_tokens``, so that prompt
            and response fit; no limit when the context is unknown.
        truncation: ``"error"`` refuses a longer prompt with one sentence; ``"left"`` keeps its last
            ``max_prompt_tokens`` tokens (the end of a prompt is what the response follows) and
            counts it in :attr:`GenerationOutput.truncated_prompts`.
        context: the model's longest sequence, or None.
        max_new_tokens: the engine's response budget.
    """

    def __init__(
        self,
        name: str,
        max_prompt_tokens: int | None,
        truncation: str,
        context: int | None,
        max_new_tokens: int,
    ) -> None:
        if truncation not in ("left", "error"):
            raise ValueError(f"{name} got truncation={truncation!r}; expected 'left' or 'error'.")
        if max_prompt_tokens is not None and (
            isinstance(max_prompt_tokens, bool)
            or not isinstance(max_prompt_tokens, int)
            or max_prompt_tokens < 1
        ):
            raise ValueError(
                f"{name} got max_prompt_tokens={max_prompt_tokens!r}; expected None or an integer "
                ">= 1."
            )
        if max_prompt_tokens is None and context is not None:
            max_prompt_tokens = context - max_new_tokens
            if max_prompt_tokens < 1:
                raise ValueError(
                    f"{name} got max_new_tokens={max_new_tokens}; expected fewer than the model's "
                    f"context of {context} tokens, to leave room for a prompt."
                )
        self.name = name
        self.limit = max_prompt_tokens
        self.truncation = truncation
        self.context = context

    def apply(self, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
        """The prompts as the engine will use them, and how many were truncated.

        Raises:
            ValueError: with ``truncation="error"``, for the first prompt over the limit.
        """
        limit = self.limit
        if limit is None or all(len(p) <= limit for p in prompts):
            return prompts, 0
        if self.truncation == "error":
            i, prompt = next((i, p) for i, p in enumerate(prompts) if len(p) > limit)
            context = "" if self.context is None else f" (the model's context is {self.context})"
            raise ValueError(
                f"{self.name} got prompt {i} of {len(prompt)} tokens; expected at most "
                f"max_prompt_tokens={limit}{context}: shorten the prompts, or set "
                "truncation='left' to keep their last max_prompt_tokens tokens."
            )
        cut = sum(len(p) > limit for p in prompts)
        return [list(p[-limit:]) for p in prompts], cut


def model_context(model: Any) -> int | None:
    """The longest sequence ``model`` takes (its config's ``max_position_embeddings``), or None."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def check_generate_args(
    prompts: list[list[int]],
    num_samples: int,
    vocab_size: int,
    extra_stop_token_ids: Sequence[int] = (),
) -> None:
    """Raise one sentence for num_samples < 1, an empty prompt or an id outside the vocabulary."""
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"generate got num_samples={num_samples}; expected an integer >= 1.")
    bad_stops = [t for t in extra_stop_token_ids if not 0 <= t < vocab_size]
    if bad_stops:
        raise ValueError(
            f"generate got extra_stop_token_ids containing {bad_stops[0]}; expected ids in "
            f"[0, {vocab_size})."
        )
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"generate got an empty prompts[{i}]; expected at least one token.")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"generate got token id {bad[0]} in prompts[{i}]; expected ids in [0, {vocab_size})."
            )


def check_state_keys(
    weights: Mapping[str, torch.Tensor], expected: Iterable[str], caller: str = "update_weights"
) -> None:
    """Raise one sentence (naming ``caller``) when ``weights`` does not have exactly the actor's
    state-dict keys."""
    keys = set(expected)
    missing = sorted(keys - set(weights))
    unexpected = sorted(set(weights) - keys)
    if missing or unexpected:
        raise ValueError(
            f"{caller} got weights with missing keys {missing[:8]} and unexpected keys "
            f"{unexpected[:8]} ({len(missing)} and {len(unexpected)} in all); expected exactly the "
            "keys of the actor's state_dict()."
        )


def check_state_dict(
    weights: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    caller: str = "update_weights",
) -> None:
    """:func:`check_state_keys`, then one sentence for the first tensor whose shape differs."""
    check_state_keys(weights, expected, caller)
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{caller} got {name} of shape {tuple(tensor.shape)}; expected "
                f"{tuple(expected[name].shape)}, the shape of the actor's state_dict()."
            )


def check_bucket(
    bucket: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    seen: set[str],
    caller: str = "update_weights_from_buckets",
) -> None:
    """Raise one sentence (naming ``caller``) for the first tensor of ``bucket`` whose key is not
    in ``shapes`` (the actor's state-dict shapes) or is already in ``seen`` (an earlier bucket),
    or whose shape differs; checks the whole bucket before any of it is used."""
    for name, tensor in bucket.items():
        if name not in shapes or name in seen:
            problem = "twice" if name in seen else "which is not a key of the actor"
            raise ValueError(
                f"{caller} got {name!r} {problem}; expected each key of the actor's "
                "state_dict() exactly once."
            )
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ValueError(
                f"{caller} got {name} of shape {tuple(tensor.shape)}; expected "
                f"{tuple(shapes[name])}, the shape of the actor's state_dict()."
            )


def check_buckets_complete(
    seen: set[str], keys: Iterable[str], caller: str = "update_weights_from_buckets"
) -> None:
    """Raise one sentence (naming ``caller``) when a key of ``keys`` (the actor's state dict) is
    not in ``seen`` once a bucket stream has ended."""
    missing = [name for name in keys if name not in seen]
    if missing:
        raise ValueError(
            f"{caller} got no tensor for {len(missing)} keys (first {missing[0]!r}); expected "
            "buckets covering the actor's whole state_dict()."
        )


@torch.no_grad()
def copy_buckets(
    buckets: Iterable[Mapping[str, torch.Tensor]],
    target: Mapping[str, torch.Tensor],
    caller: str = "update_weights_from_buckets",
) -> None:
    """Copy a stream of state-dict buckets into ``target``'s tensors, each bucket as it arrives.

    Raises:
        ValueError: (naming ``caller``) for a key that is not ``target``'s or arrives twice, a
            shape that differs (checked for a whole bucket before it is copied), or keys of
            ``target`` missing once the stream ends; the buckets before the error are already
            copied.
    """
    shapes = {name: tuple(tensor.shape) for name, tensor in target.items()}
    seen: set[str] = set()
    for bucket in buckets:
        check_bucket(bucket, shapes, seen, caller)
        for name, tensor in bucket.items():
            target[name].copy_(tensor.detach())
        seen.update(bucket)
    check_buckets_complete(seen, target, caller)
