"""Metrics whose states keep their dtypes under a module-wide dtype change.

Lightning's ``bf16-true`` / ``16-true`` precision converts the whole LightningModule with
``module.to(dtype)``, and torchmetrics applies that conversion to metric states too (only
``.half()``/``.float()``/``.double()`` are guarded). The metrics here sum in float64 and count in
int64 on purpose, so a bf16 state would lose the sums' precision and ``index_add_`` of a float64
source into it fails. :class:`KeptDtypeMetric` moves its states between devices and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torchmetrics import Metric


class KeptDtypeMetric(Metric):
    """A torchmetrics ``Metric`` whose states follow the module's device but keep their dtype
    (float64 sums, int64 counts) under ``.to(dtype)``; ``set_dtype`` still converts them."""

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = "") -> nn.Module:
        if self._dtype_convert:
            return super()._apply(fn, exclude_state)
        states = tuple(self._defaults)
        this = super()._apply(fn, exclude_state=(*exclude_state, *states))
        device = this.device  # the base class moved its device marker with ``fn``
        for key in states:
            if key in exclude_state:
                continue
            default, value = this._defaults[key], getattr(this, key)
            this._defaults[key] = _to_device(default, device)
            setattr(this, key, _to_device(value, device))
        return this


def _to_device(
    value: torch.Tensor | list[torch.Tensor], device: torch.device
) -> torch.Tensor | list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return [v.to(device) for v in value]
