"""A LoRA run with the vLLM engine: vLLM loads the merged weights under the base names (no peft name
reaches it), so at lag 0 the engine's log-probs µ equal the LoRA actor's π up to float error."""

from __future__ import annotations

import pytest

from tests.support.vllm_support import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

require_vllm()

from brace_lightning.cli import run  # noqa: E402
from brace_lightning.logs import read_scalars  # noqa: E402
from brace_lightning.models.lora import has_adapters  # noqa: E402
from tests.test_trainer import CONFIGS  # noqa: E402
from tests.test_vllm import _vllm_run  # noqa: E402


def test_fit_with_vllm_and_lora_samples_with_the_merged_weights(tmp_path) -> None:
    cli = run(_vllm_run(tmp_path, "--config", str(CONFIGS / "lora.yaml")))
    assert type(cli.datamodule.engine).__name__ == "VLLMEngine"
    assert has_adapters(cli.model.actor) and cli.model.policy_version == 3
    scalars = read_scalars(cli.trainer.logger.log_dir)
    mismatch = [value for _, value in scalars["mismatch/abs_logprob_diff"]]
    assert len(mismatch) == 3 and max(mismatch) < 1e-3, mismatch
    assert max(abs(value) for _, value in scalars["kl/mu_pi_k3"]) < 1e-5
