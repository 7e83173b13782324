"""Multi-turn rollouts: the policy calls tools, the environment answers, generation continues.

``collect_episodes`` is the multi-turn counterpart of ``collect_rollouts`` for a
:class:`~brace_lightning.tasks.env.ToolEnvironment`. It works with any
:class:`~brace_lightning.rollout.engine.RolloutEngine` through ``generate`` alone: each round,
every active episode's context (prompt + transcript so far, as token ids) goes into **one**
``engine.generate(contexts, num_samples=1, extra_stop_token_ids=...)`` call, so the engine batches
all episodes of a rollout step. Per episode, what the engine returns is cut at the first closing
marker of a tool call (:attr:`~brace_lightning.tasks.env.ToolEnvironment.stop_strings`) and at the
remaining token budget; the kept tokens are actions with the engine's log-probs, entropies and
per-token versions (the version that sampled each turn: turns of one episode may differ in async
runs). At a closing marker the environment's observation is tokenized and appended as environment
tokens: action mask False, behavior log-prob 0, version -1, entropy 0.

Stops: the last token of each closing string is passed as an extra stop id, so the engine returns
as soon as a call *may* be complete; when the decoded turn does not yet contain the closing string
(the ``>`` of ``<calc>`` for ``</calc>`` with a character tokenizer) the episode simply continues
in the next round. An engine whose ``generate`` lacks ``extra_stop_token_ids`` still gives the
same episodes in distribution: truncating a sampled response at the closing string is the same as
stopping there, only more tokens are decoded and discarded.

An episode ends at the engine's own stop (eos: finish ``"stop"``), at a closing marker whose
``observe`` returns None (``"stop"``), when the engine's per-call budget runs out (``"length"``), at
the environment's ``max_response_tokens`` (``"length"``), or at a tool call beyond ``max_turns``
(``"length"``, unanswered). An ``observe`` that raises does not end anything: the call is answered
with the environment's error observation and counted in ``info["tool_errors"]``. The rows are then
scored and padded exactly like single-turn rollouts (``collect.score_and_pad``): the verifier's
reward sits on the last action token, verifier errors (and, with ``reward_timeout``, verifier calls
that do not return in time) drop the sample and are counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from brace_lightning.rollout.collect import (
    collect_rollouts,
    encode_prompts,
    padding_id,
    score_and_pad,
)
from brace_lightning.rollout.engine import (
    FinishReason,
    GenerationOutput,
    RolloutEngine,
    accepts_extra_stops,
)
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.tasks.base import Prompt, RewardFunction
from brace_lightning.tasks.env import ToolEnvironment

logger = logging.getLogger(__name__)


@dataclass
class _Episode:
    """One episode's transcript, built up turn by turn (per-token lists, all the same length)."""

    prompt_index: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    actions: list[bool] = field(default_factory=list)
    turn_start: int = 0  # first token of the policy's current turn (after the last observation)
    turns: int = 0  # observations appended
    tool_errors: int = 0  # observe() calls that raised (answered with env.error_observation)
    finish: FinishReason | None = None  # None while active

    def add(
        self,
        tokens: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        entropy: Sequence[float],
        action: bool,
    ) -> None:
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += versions
        self.entropy += entropy
        self.actions += [action] * len(tokens)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, stop_strings: Sequence[str]) -> list[int]:
    """The last token id of each stop string (tokenized alone, no special tokens), deduplicated."""
    ids: list[int] = []
    for text in stop_strings:
        encoded = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not encoded:
            raise ValueError(
                f"stop string {text!r} tokenizes to nothing; expected a non-empty one."
            )
        if encoded[-1] not in ids:
            ids.append(encoded[-1])
    return ids


def _cut_at_stop(
    tokenizer: PreTrainedTokenizerBase,
    turn: list[int],
    segment: list[int],
    stop_strings: Sequence[str],
) -> int | None:
    """Length of the shortest prefix of ``segment`` after which ``turn + prefix`` decodes to text
    containing a stop string, or None when the whole segment does not (special tokens such as eos
    are not text: they never complete a stop string)."""

    def done(n: int) -> bool:
        text = tokenizer.decode(turn + segment[:n], skip_special_tokens=True)
        return any(stop in text for stop in stop_strings)

    if not done(len(segment)):
        return None
    low, high = 1, len(segment)  # done(high) holds; text only grows with n
    while low < high:
        middle = (low + high) // 2
        if done(middle):
            high = middle
        else:
            low = middle + 1
    return low


def collect_episodes(
    engine: RolloutEngine,
    prompts: Sequence[Prompt],
    tokenizer: PreTrainedTokenizerBase,
    env: ToolEnvironment,
    *,
    num_samples: int = 1,
    group_id_offset: int = 0,
    reward_timeout: float | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> RolloutBatch:
    """Run ``num_samples`` multi-turn episodes per prompt in ``env``, score and pad them.

    Args:
        engine: the rollout engine; every round calls ``engine.generate`` once for all active
            episodes.
        prompts: the prompts; their ``text`` is tokenized with ``tokenizer``.
        tokenizer: tokenizes observations (no special tokens added), decodes turns to find closing
            markers and transcripts for the verifier, gives the padding id.
        env: the environment (tool, budgets, verifier).
        num_samples: episodes per prompt; they share a group id.
        group_id_offset: added to the prompt index to form ``group_ids``.
        reward_timeout: seconds the verifier may take per episode (None = no limit); see
            :func:`~brace_lightning.rollout.collect.score_and_pad`.
        heartbeat: called while a timed verifier call is awaited.

    Returns:
        A :class:`RolloutBatch` in the layout of ``collect_rollouts`` (``mask`` False at
        observation tokens); ``info`` has ``collect_rollouts``'s keys (lengths count observation
        tokens too) plus ``mean_tool_calls`` and ``mean_observation_tokens`` over the kept rows and
        ``tool_errors``, the calls of all episodes whose ``env.observe`` raised (each answered with
        ``env.error_observation`` instead, so the episode goes on).
    """
    if num_samples < 1:
        raise ValueError(
            f"collect_episodes got num_samples={num_samples}; expected an integer >= 1."
        )
    if not prompts:
        raise ValueError("collect_episodes got no prompts; expected at least one.")
    pad_id = padding_id(tokenizer, "collect_episodes")
    eos_id = tokenizer.eos_token_id
    stops = tuple(env.stop_strings)
    extra = stop_token_ids(tokenizer, stops)
    kwargs = {"extra_stop_token_ids": extra} if extra and accepts_extra_stops(engine) else {}
    budget = env.max_response_tokens
    episodes = [
        _Episode(index, ids)
        for index, ids in enumerate(encode_prompts(tokenizer, prompts))
        for _ in range(num_samples)
    ]
    entropy_known = True
    while active := [e for e in episodes if e.finish is None]:
        out = engine.generate([e.prompt_ids + e.tokens for e in active], num_samples=1, **kwargs)
        if out.truncated_prompts:
            raise ValueError(
                f"collect_episodes: the engine cut {out.truncated_prompts} episode contexts (prompt "
                "+ transcript) to its max_prompt_tokens; expected contexts that fit, because the "
                "trainer scores whole transcripts: lower the environment's max_response_tokens or "
                "shorten the prompts."
            )
        if len(out) != len(active):
            raise ValueError(
                f"collect_episodes got {len(out)} samples from the engine; expected {len(active)} "
                "(one per active episode)."
            )
        entropy_known &= out.entropy is not None
        for i, episode in enumerate(active):
            segment = list(out.response_ids[i])
            finish = out.finish_reason[i]
            if not segment:  # nothing generated: the engine has nothing more to say
                episode.finish = finish
                continue
            room = budget - len(episode.tokens)
            if len(segment) > room:
                segment, finish = segment[:room], "length"
            cut = _cut_at_stop(tokenizer, episode.tokens[episode.turn_start :], segment, stops)
            if cut is not None:
                segment = segment[:cut]
            n = len(segment)
            episode.add(
                segment,
                out.logprobs[i][:n],
                out.versions[i][:n],
                out.entropy[i][:n] if out.entropy is not None else [0.0] * n,
                action=True,
            )
            if cut is not None:
                _answer_call(episode, prompts[episode.prompt_index], tokenizer, env)
            elif len(episode.tokens) >= budget or finish == "length":
                episode.finish = "length"
            elif finish == "stop" and segment[-1] in extra and segment[-1] != eos_id:
                pass  # stopped at the last token of a closing string that is not complete yet
            else:
                episode.finish = "stop"  # the engine's own stop (eos)
    generated = GenerationOutput(
        prompt_ids=[e.prompt_ids for e in episodes],
        response_ids=[e.tokens for e in episodes],
        logprobs=[e.logprobs for e in episodes],
        versions=[e.versions for e in episodes],
        prompt_index=[e.prompt_index for e in episodes],
        finish_reason=[e.finish for e in episodes],  # type: ignore[misc]  # all set by now
        entropy=[e.entropy for e in episodes] if entropy_known else None,
        action_mask=[e.actions for e in episodes],
    )
    batch = score_and_pad(
        generated,
        prompts,
        tokenizer,
        env,
        pad_id,
        group_id_offset,
        reward_timeout=reward_timeout,
        heartbeat=heartbeat,
    )
    # Observation tokens are the non-action tokens after a row's first action; one run per call.
    observed = batch.attention_mask & ~batch.mask & (batch.mask.cumsum(dim=1) > 0)
    starts = observed & ~torch.nn.functional.pad(observed, (1, 0))[:, :-1]
    rows = max(len(batch), 1)
    batch.info.update(
        mean_tool_calls=float(starts.sum()) / rows,
        mean_observation_tokens=float(observed.sum()) / rows,
        tool_errors=float(sum(e.tool_errors for e in episodes)),
    )
    return batch


def _answer_call(
    episode: _Episode, prompt: Prompt, tokenizer: PreTrainedTokenizerBase, env: ToolEnvironment
) -> None:
    """The policy closed a tool call: append the observation, or end the episode."""
    transcript = tokenizer.decode(episode.tokens, skip_special_tokens=True)
    if episode.turns >= env.max_turns:
        episode.finish = "length"  # a call beyond max_turns stays unanswered
        return
    try:
        observation = env.observe(prompt, transcript)
    except Exception as error:  # a policy-written call must not end the batch
        logger.warning("Tool error in %s.observe: %r", type(env).__name__, error)
        episode.tool_errors += 1
        observation = env.error_observation(f"the tool failed ({type(error).__name__})")
    if observation is None:
        episode.finish = "stop"
        return
    ids = list(tokenizer(observation, add_special_tokens=False)["input_ids"])
    if len(episode.tokens) + len(ids) >= env.max_response_tokens:
        episode.finish = "length"  # no room for the observation and a reply to it
        return
    episode.add(ids, [0.0] * len(ids), [-1] * len(ids), [0.0] * len(ids), action=False)
    episode.turn_start = len(episode.tokens)
    episode.turns += 1


def collect_batch(
    engine: RolloutEngine,
    prompts: Sequence[Prompt],
    tokenizer: PreTrainedTokenizerBase,
    *,
    reward: RewardFunction | None,
    env: ToolEnvironment | None,
    num_samples: int = 1,
    group_id_offset: int = 0,
    reward_timeout: float | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> RolloutBatch:
    """One rollout batch: multi-turn episodes in ``env`` when it is set (scored by its verifier),
    else single-turn responses scored by ``reward`` (:func:`collect_rollouts`); a verifier call
    that runs past ``reward_timeout`` seconds drops its sample (``rollout/reward_timeout.py``;
    ``heartbeat`` is called while such a call is awaited).

    ``batch.info`` gets the batch's wall time (``generate_s``: generation, tools and scoring) and
    ``gen_tokens_per_s`` (generated action tokens per second).
    """
    start = time.monotonic()
    if env is not None:
        batch = collect_episodes(
            engine,
            prompts,
            tokenizer,
            env,
            num_samples=num_samples,
            group_id_offset=group_id_offset,
            reward_timeout=reward_timeout,
            heartbeat=heartbeat,
        )
    else:
        assert reward is not None, "the data modules check that reward or env is set"
        batch = collect_rollouts(
            engine,
            prompts,
            tokenizer,
            reward,
            num_samples=num_samples,
            group_id_offset=group_id_offset,
            reward_timeout=reward_timeout,
            heartbeat=heartbeat,
        )
    seconds = time.monotonic() - start
    batch.info.update(generate_s=seconds, gen_tokens_per_s=batch.num_actions / max(seconds, 1e-9))
    return batch


def check_reward_or_env(reward: RewardFunction | None, env: ToolEnvironment | None) -> None:
    """ValueError unless exactly one of ``reward`` (single-turn) and ``env`` (multi-turn) is set."""
    if env is None and reward is None:
        raise ValueError("reward must be a RewardFunction when env is None; got None.")
    if env is not None and reward is not None:
        raise ValueError(
            f"reward must be None when env is set (the environment's own verifier scores its "
            f"episodes); got reward={type(reward).__name__} with env={type(env).__name__}."
        )
