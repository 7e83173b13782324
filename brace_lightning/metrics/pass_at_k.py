"""mean@k and pass@k over n sampled responses per prompt (the paper's mean@32 and pass@32).

With ``n`` responses to a prompt of which ``c`` are correct, the unbiased estimator of pass@k
(the chance that at least one of k responses drawn without replacement from the n is correct;
Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1) is

    pass@k = 1 − C(n − c, k) / C(n, k),  for n ≥ k,

which is 1 when n − c < k. It is computed as 1 − exp(lnΓ(n−c+1) − lnΓ(n−c−k+1) − lnΓ(n+1) +
lnΓ(n−k+1)) in float64, vectorised over prompts (no factorial overflows: C(64, 32) already needs
61 bits). mean@n is the mean fraction of correct responses per prompt. A response the verifier
failed to score counts as not correct: ``n`` is the number requested, not the number scored.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["correct_per_prompt", "pass_at_k", "sampling_metrics"]


def pass_at_k(num_samples: int, num_correct: torch.Tensor, k: int) -> torch.Tensor:
    """Unbiased pass@k per prompt (module docstring), ``[G]`` float64.

    Args:
        num_samples: n, responses per prompt (n ≥ k).
        num_correct: ``[G]`` integers c in [0, n], correct responses per prompt.
        k: responses the estimate is for, 1 ≤ k ≤ n.

    Raises:
        ValueError: for k outside [1, n] or a count outside [0, n].
    """
    if not 1 <= k <= num_samples:
        raise ValueError(
            f"pass@k got k={k} with {num_samples} samples per prompt; expected 1 <= k <= samples "
            "per prompt (the estimator needs n >= k)."
        )
    c = num_correct.to(torch.float64)
    if bool(((c < 0) | (c > num_samples)).any()):
        raise ValueError(
            f"pass@k got correct counts {num_correct.tolist()}; expected integers in "
            f"[0, {num_samples}]."
        )
    n = torch.full_like(c, float(num_samples))
    wrong = n - c
    # log C(n − c, k) − log C(n, k); only where n − c ≥ k (else every k-subset holds a correct one)
    safe = torch.clamp(wrong, min=float(k))
    log_ratio = (
        torch.lgamma(safe + 1)
        - torch.lgamma(safe - k + 1)
        - torch.lgamma(n + 1)
        + torch.lgamma(n - k + 1)
    )
    return torch.where(wrong < k, torch.ones_like(c), 1.0 - torch.exp(log_ratio))


def correct_per_prompt(
    prompt_index: torch.Tensor, correct: torch.Tensor, num_prompts: int
) -> torch.Tensor:
    """``[num_prompts]`` counts of correct responses per prompt.

    Args:
        prompt_index: ``[B]`` the prompt (0 … num_prompts − 1) each scored response answers.
        correct: ``[B]`` bool, whether it is correct.
        num_prompts: prompts of the batch (a prompt whose every response was dropped counts 0).
    """
    return torch.bincount(prompt_index[correct.bool()], minlength=num_prompts)[:num_prompts]


def sampling_metrics(
    num_correct: torch.Tensor, num_samples: int, ks: Sequence[int]
) -> dict[str, float]:
    """``{"mean@n": …, "pass@k": … for k in ks}`` averaged over prompts.

    Args:
        num_correct: ``[G]`` correct responses per prompt (:func:`correct_per_prompt`).
        num_samples: n, responses requested per prompt.
        ks: the k of each pass@k (each in [1, n]).
    """
    metrics = {f"mean@{num_samples}": float(num_correct.double().mean() / num_samples)}
    for k in ks:
        metrics[f"pass@{k}"] = float(pass_at_k(num_samples, num_correct, k).mean())
    return metrics
