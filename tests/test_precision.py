"""Lightning's precision settings run the quickstart on CPU: ``bf16-true`` (the whole module in
bf16), ``bf16-mixed`` and ``16-mixed`` (autocast; Lightning runs it as ``bf16-mixed`` on CPU), with the metrics' float64 sums kept
(``metrics/base.py``) and every logged value a finite float32 or wider number."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from brace_lightning.cli import run
from brace_lightning.logs import read_scalars
from tests.test_trainer import small_run

#: One critic-only rollout step, then two with the actor; rewards with spread, so β is defined.
STEPS = ["--model.critic_warmup_steps=1", "--data.reward=tests.test_trainer.ParityReward"]


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed", "16-mixed"])
def test_the_quickstart_trains_at_each_precision(tmp_path: Path, precision: str) -> None:
    cli = run(small_run(tmp_path, *STEPS, f"--trainer.precision={precision}", steps=3))
    # Lightning runs 16-mixed as bf16-mixed on CPU (no fp16 autocast there), with a warning.
    ran = "bf16-mixed" if precision == "16-mixed" else precision
    assert cli.trainer.precision == ran and cli.model.rollout_step == 3
    expected = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert next(cli.model.actor.parameters()).dtype == expected
    beta = cli.model.horizon_beta
    assert beta.sum_x.dtype == torch.float64 and beta.n.dtype == torch.int64
    scalars = read_scalars(cli.trainer.logger.log_dir)
    for name in ("actor/loss", "critic/loss", "critic/grad_norm", "critic/beta"):
        values = [value for _, value in scalars[name]]
        assert len(values) == (2 if name == "actor/loss" else 3), name
        assert all(math.isfinite(value) for value in values), name


def test_gradients_are_clipped_after_the_grad_scaler_unscales_them(tmp_path: Path) -> None:
    """fp16 autocast with a GradScaler (``16-mixed`` on a GPU; here on CPU through the plugin):
    the logged gradient norm is the unscaled one, as in a float32 run, not ~2**10 times larger,
    and the clip to max_grad_norm acts on unscaled gradients (``optim.clipped_step``)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # no fp16 overflow at this size
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    scaled = run(
        small_run(tmp_path / "fp16", *STEPS, steps=2), trainer_defaults={"plugins": [plugin]}
    )
    plain = run(small_run(tmp_path / "fp32", *STEPS, steps=2))
    assert scaled.trainer.precision_plugin is plugin and scaler.get_scale() >= 1.0
    for name in ("critic/grad_norm", "actor/grad_norm"):
        fp16 = [v for _, v in read_scalars(scaled.trainer.logger.log_dir)[name]]
        fp32 = [v for _, v in read_scalars(plain.trainer.logger.log_dir)[name]]
        assert fp16 and all(math.isfinite(v) for v in fp16), name
        for a, b in zip(fp16, fp32, strict=True):
            assert 0.5 < a / b < 2.0, (name, a, b)
