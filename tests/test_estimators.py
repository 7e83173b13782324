"""Config classes: validation, that each flag reaches the kernel, and YAML ``class_path`` selection."""

from __future__ import annotations

import pytest
import torch
from jsonargparse import ArgumentParser

from brace_lightning.targets import BRACE, GAE, ValueTarget, VTrace
from brace_lightning.targets.functional import brace, gae, vtrace
from tests.test_targets import layout_mask, random_inputs


def call(target: ValueTarget, seed: int = 0):
    mask = layout_mask(40)
    r, v, t, b = random_inputs(mask, seed=seed, scale=1.0)
    return target(rewards=r, values=v, target_logprobs=t, behavior_logprobs=b, mask=mask)


def test_classes_call_their_kernels():
    mask = layout_mask(40)
    r, v, t, b = random_inputs(mask, seed=0)
    torch.testing.assert_close(
        call(GAE(gamma=0.9, lmbda=0.8)).returns, gae(r, v, mask, gamma=0.9, lmbda=0.8).returns
    )
    torch.testing.assert_close(
        call(VTrace(rho_bar=2.0, c_bar=1.5)).returns,
        vtrace(r, v, t, b, mask, rho_bar=2.0, c_bar=1.5).returns,
    )
    torch.testing.assert_close(
        call(BRACE(k=3, mc_tail=False)).returns, brace(r, v, t, b, mask, k=3, mc_tail=False).returns
    )


@pytest.mark.parametrize(
    ("cls", "default", "changed"),
    [
        (GAE, {}, {"gamma": 0.9}),
        (GAE, {}, {"lmbda": 0.5}),
        (VTrace, {}, {"gamma": 0.9}),
        (VTrace, {}, {"lmbda": 0.5}),
        (VTrace, {"rho_bar": 2.0, "c_bar": 1.0}, {"rho_bar": 1.0, "c_bar": 1.0}),
        (VTrace, {"rho_bar": 2.0, "c_bar": 1.0}, {"rho_bar": 2.0, "c_bar": 0.5}),
        (BRACE, {}, {"gamma": 0.9}),
        (BRACE, {}, {"lmbda": 0.5}),
        (BRACE, {}, {"rho_bar": 1.5}),
        (BRACE, {}, {"c_bar": 0.8}),
        (BRACE, {"k": 100}, {"k": 4}),
        (BRACE, {"k": 4}, {"k": 4, "mc_tail": False}),
        (BRACE, {"k": 4}, {"k": None}),
    ],
)
def test_every_flag_changes_the_target(cls, default, changed):
    assert not torch.allclose(call(cls(**default)).returns, call(cls(**changed)).returns)


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (GAE, {"gamma": 2.0}, "gamma"),
        (GAE, {"lmbda": -1.0}, "lmbda"),
        (VTrace, {"rho_bar": -1.0}, "rho_bar"),
        (VTrace, {"c_bar": 2.0}, "c_bar"),
        (BRACE, {"k": -3}, "k"),
        (BRACE, {"k": 2.5}, "k"),
        (BRACE, {"c_bar": 0.0}, "c_bar"),
        (BRACE, {"mc_tail": "yes"}, "mc_tail"),
        (BRACE, {"rho_in_advantage": 1}, "rho_in_advantage"),
        (VTrace, {"rho_in_advantage": None}, "rho_in_advantage"),
    ],
)
def test_invalid_hyperparameters_raise_naming_the_argument(cls, kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must"):
        cls(**kwargs)


def test_repr_lists_hyperparameters():
    assert (
        repr(BRACE(k=7))
        == "BRACE(gamma=1.0, lmbda=1.0, rho_bar=1.2, c_bar=1.1, k=7, mc_tail=True, log_budget=None, "
        "rho_in_advantage=False)"
    )


def test_yaml_class_path_swaps_the_target():
    parser = ArgumentParser()
    parser.add_argument("--value_target", type=ValueTarget, default=None)
    for text, cls, attr, value in [
        (
            "value_target:\n  class_path: brace_lightning.targets.GAE\n  init_args: {lmbda: 0.95}",
            GAE,
            "lmbda",
            0.95,
        ),
        (
            "value_target:\n  class_path: brace_lightning.targets.VTrace\n  init_args: {rho_bar: 2.0}",
            VTrace,
            "rho_bar",
            2.0,
        ),
        (
            "value_target:\n  class_path: brace_lightning.targets.BRACE\n  init_args: {k: 20, mc_tail: false}",
            BRACE,
            "k",
            20,
        ),
    ]:
        cfg = parser.parse_string(text)
        target = parser.instantiate_classes(cfg).value_target
        assert isinstance(target, cls) and getattr(target, attr) == value
    with pytest.raises(Exception, match="k must be an integer"):
        cfg = parser.parse_string(
            "value_target:\n  class_path: brace_lightning.targets.BRACE\n  init_args: {k: -1}"
        )
        parser.instantiate_classes(cfg)
