"""What validation and ``test`` sample and report: the held-out prompts, the responses per prompt
and the k of each pass@k.

The validation prompts are, in this order: ``val_task`` when the recipe names one (a JSONL file of
held-out prompts, a hub dataset's test split, another generated task); else the training task's
held-out part (``task.held_out()``: a generated task with ``split="train"``, ``tasks/split.py``);
else the training task itself (the behaviour of a recipe that names none). Each validation batch
samples ``samples_per_prompt`` responses per prompt and reports mean@n and pass@k
(``metrics/pass_at_k.py``) in its ``info``, which ``evaluation.py`` logs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from brace_lightning.metrics.pass_at_k import correct_per_prompt, sampling_metrics
from brace_lightning.rollout.types import RolloutBatch
from brace_lightning.tasks.base import PromptSource

#: ``info`` key of a validation batch's prompt count (the weight of its mean@n and pass@k).
PROMPTS_KEY = "prompts"


@dataclass(frozen=True)
class EvaluationPlan:
    """The validation prompts, responses per prompt (n) and the k of each pass@k (each ≤ n)."""

    prompts: PromptSource
    samples_per_prompt: int
    pass_k: tuple[int, ...]

    @classmethod
    def of(
        cls,
        task: PromptSource,
        val_task: PromptSource | None,
        samples_per_prompt: int,
        pass_k: Sequence[int] | None,
    ) -> EvaluationPlan:
        """The plan of a data module's arguments (module docstring); ``pass_k`` None is
        ``[samples_per_prompt]``.

        Raises:
            ValueError: for a k that is not an integer in [1, samples_per_prompt].
        """
        prompts = val_task if val_task is not None else task.held_out()
        ks = (samples_per_prompt,) if pass_k is None else tuple(pass_k)
        for k in ks:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= samples_per_prompt:
                raise ValueError(
                    f"pass_k must hold integers in [1, {samples_per_prompt}] (pass@k needs at "
                    f"least k responses per prompt: raise val_samples_per_prompt); got "
                    f"{list(ks)!r}."
                )
        return cls(task if prompts is None else prompts, samples_per_prompt, ks)

    def metrics(
        self, batch: RolloutBatch, group_id_offset: int, num_prompts: int
    ) -> dict[str, float]:
        """mean@n and pass@k of a validation batch of ``num_prompts`` prompts whose group ids
        start at ``group_id_offset``, and its prompt count (:data:`PROMPTS_KEY`); {} for a batch
        without correctness."""
        if batch.correct is None:
            return {}
        counts = correct_per_prompt(batch.group_ids - group_id_offset, batch.correct, num_prompts)
        return {
            **sampling_metrics(counts, self.samples_per_prompt, self.pass_k),
            PROMPTS_KEY: float(num_prompts),
        }
