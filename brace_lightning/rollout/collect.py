"""Turn prompts into a scored, padded :class:`~brace_lightning.rollout.types.RolloutBatch`.

``collect_rollouts`` is the single-turn rollout: tokenize the prompts, sample from an engine, decode,
score with a :class:`~brace_lightning.tasks.base.RewardFunction`, and pad everything into the batch
layout of ``rollout/types.py`` (prompts left-padded, responses right-padded and starting at the same
column, the verifier's reward on the last action token).

A reward function that raises (or returns a non-finite or non-numeric value, a bool or a value beyond
float32's range; :func:`reward_value` says which types are read) does not stop the run and its sample
is not given a made-up reward: the sample is dropped and counted in
``batch.info["dropped_reward_error"]`` so that ``generated = kept + dropped`` stays visible.
A :class:`~brace_lightning.tasks.base.BatchedReward` (a reward model) scores the whole batch in one
call. With ``reward_timeout`` set, a call that does not return within that many seconds (per
sample) is abandoned and its samples dropped and counted the same way (also in
``batch.info["reward_timeouts"]``); a batch whose every sample timed out ends the run with one
sentence (``rollout/reward_timeout.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from brace_lightning.console import ErrorsOnce
from brace_lightning.rollout.engine import GenerationOutput, RolloutEngine
from brace_lightning.rollout.reward_timeout import (
    RewardDeadline,
    RewardTimeout,
    TooManyHungRewards,
)
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.tasks.base import BatchedReward, Prompt, RewardFunction, encode_prompts

logger = logging.getLogger(__name__)


def collect_rollouts(
    engine: RolloutEngine,
    prompts: Sequence[Prompt],
    tokenizer: PreTrainedTokenizerBase,
    reward_fn: RewardFunction,
    *,
    num_samples: int = 1,
    group_id_offset: int = 0,
    reward_timeout: float | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> RolloutBatch:
    """Generate, score and pad ``num_samples`` responses for each prompt.

    Args:
        engine: the rollout engine (its current weights and version sample every token).
        prompts: the prompts; their ``text`` is tokenized with ``tokenizer``.
        tokenizer: decodes completions for the reward function (special tokens skipped) and gives
            the padding id (``pad_token_id``, else ``eos_token_id``).
        reward_fn: scores ``(prompt, completion text)``; ``is_correct`` fills ``batch.correct``.
        num_samples: responses per prompt; they share a group id.
        group_id_offset: added to the prompt index to form ``group_ids`` (keeps ids unique across
            batches that are later mixed).
        reward_timeout: seconds each sample's scoring may take (None = no limit); see
            :func:`score_and_pad`.
        heartbeat: called while a timed reward call is awaited (see :func:`score_and_pad`).

    Returns:
        A :class:`RolloutBatch` with ``B = kept samples`` rows and ``T = longest prompt + longest
        response`` columns, prompt-major order; ``info`` holds ``generated``,
        ``dropped_reward_error``, ``truncated_prompts`` (samples whose prompt the engine cut to
        its ``max_prompt_tokens``), ``mean_response_length``, ``max_response_length``,
        ``truncated_fraction``, ``mean_score``, ``accuracy``.
    """
    if num_samples < 1:
        raise ValueError(
            f"collect_rollouts got num_samples={num_samples}; expected an integer >= 1."
        )
    if not prompts:
        raise ValueError("collect_rollouts got no prompts; expected at least one.")
    pad_id = padding_id(tokenizer, "collect_rollouts")
    out = engine.generate(encode_prompts(tokenizer, prompts), num_samples=num_samples)
    if len(out) != len(prompts) * num_samples:
        raise ValueError(
            f"collect_rollouts got {len(out)} samples from the engine; expected "
            f"{len(prompts) * num_samples} (prompts x num_samples)."
        )
    return score_and_pad(
        out,
        prompts,
        tokenizer,
        reward_fn,
        pad_id,
        group_id_offset,
        reward_timeout=reward_timeout,
        heartbeat=heartbeat,
    )


def padding_id(tokenizer: PreTrainedTokenizerBase, caller: str) -> int:
    """The tokenizer's ``pad_token_id``, else its ``eos_token_id``; ValueError when it has neither."""
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    if pad_id is None:
        raise ValueError(
            f"{caller} got a tokenizer with neither pad_token_id nor eos_token_id; expected one "
            "of them for padding."
        )
    return pad_id


def score_and_pad(
    out: GenerationOutput,
    prompts: Sequence[Prompt],
    tokenizer: PreTrainedTokenizerBase,
    reward_fn: RewardFunction,
    pad_id: int,
    group_id_offset: int,
    *,
    reward_timeout: float | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> RolloutBatch:
    """Score every sample of ``out`` (dropping and counting reward errors) and pad the kept ones.

    The reward function sees the decoded response (special tokens skipped; tool observations of a
    multi-turn episode included). ``batch.info`` gets the counters listed in
    :func:`collect_rollouts`; response lengths count every response token, observations included.
    With ``reward_timeout`` (seconds, checked by the data modules) each sample's ``reward_fn`` and
    ``is_correct`` calls run in a worker thread; a sample whose calls do not return in time is
    dropped, counted in ``dropped_reward_error`` and in ``info["reward_timeouts"]``; ``heartbeat``
    is called while a call is awaited (:class:`~brace_lightning.rollout.reward_timeout.RewardDeadline`).

    Raises:
        RuntimeError: when every sample of the batch timed out (the verifier is hung, not slow on
            a few answers), or when too many abandoned calls are still running
            (:data:`~brace_lightning.rollout.reward_timeout.MAX_ABANDONED`).
    """
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    kept, scores, correct = [], [], []
    dropped = timed_out = 0
    name = type(reward_fn).__name__
    errors = ErrorsOnce(f"reward {name}", logger)  # one traceback per distinct error (console.py)
    # a batched reward gets reward_timeout seconds per sample for its one call
    limit = None if reward_timeout is None else reward_timeout * _calls_per_sample(reward_fn, out)
    deadline = None if limit is None else RewardDeadline(limit, name, heartbeat)
    with deadline or contextlib.nullcontext():
        batched = None
        if isinstance(reward_fn, BatchedReward):
            batched = _score_batch(
                reward_fn, [prompts[i] for i in out.prompt_index], texts, deadline
            )
        for i, (index, text) in enumerate(zip(out.prompt_index, texts, strict=True)):
            prompt = prompts[index]
            try:
                if batched is not None:
                    score, is_correct = _outcome(batched[i])
                elif deadline is None:
                    score, is_correct = _score(reward_fn, prompt, text)
                else:
                    score, is_correct = deadline.call(_score, reward_fn, prompt, text)
            except TooManyHungRewards:
                raise
            except Exception as error:  # a user's verifier must not kill the run
                dropped += 1
                timed_out += isinstance(error, RewardTimeout)
                errors.add(error)
                continue
            kept.append(i)
            scores.append(score)
            correct.append(is_correct)
    errors.report(len(out), "dropped, counted in data/count/dropped_reward_error")
    if timed_out and timed_out == len(out):
        raise RuntimeError(
            f"every one of the {len(out)} samples of a rollout batch timed out in the reward "
            f"{name} (reward_timeout={reward_timeout:g} s); check that the verifier returns (a "
            "server it needs may be down), or raise reward_timeout if it is only slow."
        )
    batch = _pad(out, kept, scores, correct, pad_id, group_id_offset)
    lengths = [len(out.response_ids[i]) for i in kept]
    batch.info.update(
        generated=float(len(out)),
        dropped_reward_error=float(dropped),
        truncated_prompts=float(out.truncated_prompts),
        mean_response_length=sum(lengths) / len(lengths) if lengths else 0.0,
        max_response_length=float(max(lengths, default=0)),
        truncated_fraction=(
            sum(out.finish_reason[i] == "length" for i in kept) / len(kept) if kept else 0.0
        ),
        mean_score=sum(scores) / len(scores) if scores else 0.0,
        accuracy=sum(correct) / len(correct) if correct else 0.0,
    )
    if reward_timeout is not None:  # absent otherwise: runs without a timeout log what they did
        batch.info["reward_timeouts"] = float(timed_out)
    return batch


def _score(reward_fn: RewardFunction, prompt: Prompt, text: str) -> tuple[float, bool]:
    """``(reward, is_correct)`` of one sample (the reward as :func:`reward_value` reads it)."""
    return reward_value(reward_fn(prompt, text)), bool(reward_fn.is_correct(prompt, text))


#: Largest reward magnitude kept: rewards are stored as float32, beyond which they become inf.
MAX_REWARD = float(torch.finfo(torch.float32).max)


def reward_value(score: object) -> float:
    """A reward function's return value as a float, the same way for every real number type.

    Accepted: a Python ``int`` or ``float``, a NumPy integer or floating scalar (also a 0-dim
    array) and a 0-dim or one-element torch tensor of an integer or floating dtype, whose value is
    finite and within float32's range (``abs(score) <= 3.4e38``; rewards are stored as float32).
    Refused: ``bool`` (also NumPy's and a bool tensor: a verifier that returns whether the answer is
    right should return ``1.0``/``0.0``, or implement ``is_correct``), anything else non-numeric,
    NaN, ±inf and values beyond float32's range.

    Raises:
        ValueError: for a refused value (the caller drops and counts the sample).
    """
    value = score
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            value = None
        else:
            value = value.item()
    elif type(value).__module__ == "numpy" and hasattr(value, "ndim") and value.ndim == 0:
        value = value.item()  # a NumPy scalar or 0-dim array: its Python int, float or bool
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            f"reward function returned {score!r}; expected a real number (an int, a float, a NumPy "
            "number or a one-element tensor; a bool is refused)."
        )
    if not abs(value) <= MAX_REWARD:  # also NaN and ±inf; exact for ints of any size
        raise ValueError(
            f"reward function returned {score!r}; expected a finite value within float32's range "
            f"(at most {MAX_REWARD:.3g} in magnitude)."
        )
    return float(value)


def _calls_per_sample(reward_fn: RewardFunction, out: GenerationOutput) -> int:
    """Samples one timed call scores: the whole batch for a :class:`BatchedReward`, else one."""
    return max(len(out), 1) if isinstance(reward_fn, BatchedReward) else 1


def _score_batch(
    reward_fn: BatchedReward,
    prompts: Sequence[Prompt],
    texts: Sequence[str],
    deadline: RewardDeadline | None,
) -> list[tuple[float, bool] | Exception]:
    """Every sample's ``(reward, is_correct)`` from one ``score_batch`` call, or the error that
    drops it: the call's own error (or timeout) for every sample, or a per-sample ValueError for
    a score that is not a finite number.

    Raises:
        TooManyHungRewards: as :meth:`RewardDeadline.call`.
    """
    try:
        if deadline is None:
            raw = reward_fn.score_batch(prompts, texts)
        else:
            raw = deadline.call(reward_fn.score_batch, prompts, texts)
        if len(raw) != len(texts):
            raise ValueError(
                f"{type(reward_fn).__name__}.score_batch returned {len(raw)} rewards for "
                f"{len(texts)} completions; expected one per completion."
            )
    except TooManyHungRewards:
        raise
    except Exception as error:  # a user's reward model must not kill the run
        return [error] * len(texts)
    outcomes: list[tuple[float, bool] | Exception] = []
    for value in raw:
        try:
            score = reward_value(value)
            outcomes.append((score, bool(reward_fn.correct(score))))
        except Exception as error:
            outcomes.append(error)
    return outcomes


def _outcome(outcome: tuple[float, bool] | Exception) -> tuple[float, bool]:
    """The ``(reward, is_correct)`` of a :func:`_score_batch` outcome; its error raised."""
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def generation_batch(out: GenerationOutput, pad_id: int = 0) -> RolloutBatch:
    """Every sample of ``out`` in the :class:`RolloutBatch` layout, unscored (rewards and scores 0)."""
    n = len(out)
    return _pad(out, list(range(n)), [0.0] * n, [False] * n, pad_id, 0)


def max_logprob_gap(
    model: torch.nn.Module, batch: RolloutBatch, *, temperature: float = 1.0
) -> float:
    """max |log µ − log π| over the actions of ``batch``: the engine's recorded log-probs against
    ``model``'s forward pass (:func:`~brace_lightning.models.policy.token_logprobs`) at
    ``temperature``. With the engine's weights in ``model`` it measures engine/trainer mismatch."""
    from brace_lightning.models.policy import token_logprobs

    device = next(model.parameters()).device
    with torch.no_grad():
        logprobs, _ = token_logprobs(
            model,
            batch.input_ids.to(device),
            batch.attention_mask.to(device),
            temperature=temperature,
        )
    gap = (logprobs.float().cpu() - batch.behavior_logprobs)[batch.mask].abs()
    return float(gap.max()) if gap.numel() else 0.0


def _pad(
    out: GenerationOutput,
    kept: list[int],
    scores: list[float],
    correct: list[bool],
    pad_id: int,
    group_id_offset: int,
) -> RolloutBatch:
    """Lay the kept samples out as ``[B, T]`` tensors (prompts left-, responses right-padded).

    With ``out.action_mask`` the response's environment tokens get ``mask`` False, behavior
    log-prob 0, version -1 and entropy 0, and the reward sits on the row's last action token.
    """
    prompt_width = max((len(out.prompt_ids[i]) for i in kept), default=0)
    response_width = max((len(out.response_ids[i]) for i in kept), default=0)
    b, t = len(kept), prompt_width + response_width
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(b, t, dtype=torch.bool)
    mask = torch.zeros(b, t, dtype=torch.bool)
    behavior_logprobs = torch.zeros(b, t, dtype=torch.float32)
    versions = torch.full((b, t), -1, dtype=torch.long)
    rewards = torch.zeros(b, t, dtype=torch.float32)
    entropy = None if out.entropy is None else torch.zeros(b, t, dtype=torch.float32)
    for row, i in enumerate(kept):
        prompt, response = out.prompt_ids[i], out.response_ids[i]
        start, end = prompt_width - len(prompt), prompt_width + len(response)
        input_ids[row, start:prompt_width] = torch.tensor(prompt, dtype=torch.long)
        input_ids[row, prompt_width:end] = torch.tensor(response, dtype=torch.long)
        attention_mask[row, start:end] = True
        actions = (
            torch.ones(len(response), dtype=torch.bool)
            if out.action_mask is None
            else torch.tensor(out.action_mask[i], dtype=torch.bool)
        )
        mask[row, prompt_width:end] = actions
        behavior_logprobs[row, prompt_width:end] = torch.where(
            actions, torch.tensor(out.logprobs[i]), 0.0
        )
        versions[row, prompt_width:end] = torch.where(
            actions, torch.tensor(out.versions[i], dtype=torch.long), -1
        )
        if entropy is not None:
            entropy[row, prompt_width:end] = torch.where(actions, torch.tensor(out.entropy[i]), 0.0)
        if bool(actions.any()):
            last = prompt_width + int(actions.nonzero().max())
            rewards[row, last] = scores[row]
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mask=mask,
        behavior_logprobs=behavior_logprobs,
        versions=versions,
        rewards=rewards,
        scores=torch.tensor(scores, dtype=torch.float32),
        group_ids=torch.tensor(
            [out.prompt_index[i] + group_id_offset for i in kept], dtype=torch.long
        ),
        entropy=entropy,
        correct=torch.tensor(correct, dtype=torch.bool),
    )
