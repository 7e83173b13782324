"""Every YAML file under ``configs/`` parses and instantiates with the CLI's own parser.

A file whose first line starts with ``# Overlay`` is an overlay and is parsed on top of
``configs/quickstart.yaml``; any other file is a whole recipe and is parsed alone. The CLI builds
model, data module and trainer (``run=False``: nothing is trained), so a missing argument or an
invalid value fails here, and the parsed configuration must contain every value the file sets
(nothing renamed or dropped on the way). The actor-objective overlays write out the defaults of
the class they select, and there is one for every objective.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import brace_lightning.objectives as objectives
from brace_lightning.cli import run

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
GSM8K_SAMPLE = Path(__file__).resolve().parent / "data" / "gsm8k_sample.jsonl"
YAMLS = sorted(CONFIGS.rglob("*.yaml"))
OVERLAYS = [path for path in YAMLS if path.read_text().startswith("# Overlay")]
RECIPES = [path for path in YAMLS if path not in OVERLAYS]


def _ids(paths: list[Path]) -> list[str]:
    return [str(path.relative_to(CONFIGS)) for path in paths]


def cpu_stand_ins(config: dict[str, Any]) -> list[str]:
    """CLI overrides that let a GPU recipe instantiate on this CPU machine, offline.

    GPU recipes name hub models and datasets and ask for GPUs; the test swaps exactly those values
    for the tiny character model, the shipped GSM8K sample and one CPU process, and removes them
    from ``config`` (the values the parsed configuration is then checked against). Everything else
    — targets, objectives, engines, data-module settings, strategy arguments — is instantiated as
    the file says.
    """
    trainer, model = config.get("trainer", {}), config.get("model", {})
    data = config.get("data", {}).get("init_args", {})
    if trainer.get("accelerator") != "gpu" or torch.cuda.is_available():
        return []
    args = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true"]
    for key in ("accelerator", "devices", "precision"):
        trainer.pop(key, None)
    if trainer.pop("strategy", None) is not None:
        args.append("--trainer.strategy=auto")
    if model.get("actor", "tiny-char") != "tiny-char":
        args.append("--model.actor=tiny-char")
        model.pop("actor")
    if data.pop("tokenizer", "tiny-char") != "tiny-char":
        args.append("--data.init_args.tokenizer=tiny-char")
    task = data.get("task", {}).get("init_args", {})
    if "source" in task:
        args.append(f"--data.init_args.task.init_args.source={GSM8K_SAMPLE}")
        task.pop("source")
    return args


def parsed_config(monkeypatch: pytest.MonkeyPatch, *configs: Path | str) -> dict[str, Any]:
    """The configuration the CLI resolves from ``configs`` (files, then ``--key=value`` overrides),
    after instantiating every class."""
    monkeypatch.setattr(sys, "argv", ["brace-lightning"])  # pytest's own arguments are not ours
    args = []
    for path in configs:
        args += [path] if isinstance(path, str) else ["--config", str(path)]
    cli = run([*args, "--trainer.logger=false"], run=False)
    config = cli.config.as_dict()
    config["trainer"].pop("logger")
    return config


def assert_contains(merged: Any, overlay: Any, where: str = "") -> None:
    """Every key and value of ``overlay`` is present in ``merged`` (lists item by item)."""
    if isinstance(overlay, list):
        ok = isinstance(merged, list | tuple) and len(merged) == len(overlay)
        assert ok, f"{where}: parsed {merged!r}, the file says {overlay!r}"
        for i, (a, b) in enumerate(zip(merged, overlay, strict=True)):
            assert_contains(a, b, f"{where}[{i}]")
    elif isinstance(overlay, dict):
        assert isinstance(merged, dict), f"{where}: expected a mapping, got {merged!r}"
        for key, value in overlay.items():
            assert key in merged, f"{where}.{key} is missing from the parsed configuration"
            assert_contains(merged[key], value, f"{where}.{key}")
    else:
        assert merged == overlay, f"{where}: parsed {merged!r}, the file says {overlay!r}"


def test_the_config_folder_holds_recipes_and_overlays() -> None:
    assert QUICKSTART in RECIPES
    # Files in a subfolder only select one component: they are all overlays, except the GPU
    # recipes (whole recipes for real models) and the evidence recipes (docs/results_lm.md).
    whole = (CONFIGS / "gpu", CONFIGS / "evidence")
    assert {p for p in YAMLS if p.parent not in (CONFIGS, *whole)} <= set(OVERLAYS)
    assert {p for p in YAMLS if p.parent in whole} <= set(RECIPES)
    assert {path.parent.name for path in OVERLAYS} >= {"targets", "objectives"}


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_every_recipe_parses(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = yaml.safe_load(path.read_text())
    recipe.get("trainer", {}).pop("logger", None)
    stand_ins = cpu_stand_ins(recipe)
    parsed = parsed_config(monkeypatch, path, *stand_ins)
    assert_contains(parsed, recipe)
    # The long-response path by default: packed rows under a token budget (log-probs are chunked
    # in every path that can).
    assert parsed["model"]["pack_sequences"] is True
    assert parsed["model"]["max_tokens_per_micro_batch"] is not None


@pytest.mark.parametrize("path", OVERLAYS, ids=_ids(OVERLAYS))
def test_every_overlay_parses_on_top_of_the_quickstart(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overlay = yaml.safe_load(path.read_text())
    assert isinstance(overlay, dict) and overlay, f"{path} is empty"
    overlay.get("trainer", {}).pop("logger", None)
    stand_ins = cpu_stand_ins(overlay)
    assert_contains(parsed_config(monkeypatch, QUICKSTART, path, *stand_ins), overlay)


#: Overlays of configs/objectives/ that select an actor objective; the other one there,
#: kl_reference.yaml, adds the KL to the reference policy to whichever objective is selected.
OBJECTIVE_OVERLAYS = sorted(
    path
    for path in (CONFIGS / "objectives").glob("*.yaml")
    if "actor_objective" in yaml.safe_load(path.read_text())["model"]
)
KL_OVERLAY = CONFIGS / "objectives" / "kl_reference.yaml"


def _class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", OBJECTIVE_OVERLAYS, ids=_ids(OBJECTIVE_OVERLAYS))
def test_objective_overlays_write_out_the_class_defaults(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("# Overlay: "), "the first line says what the overlay selects"
    selected = yaml.safe_load(text)["model"]["actor_objective"]
    cls = _class(selected["class_path"])
    assert issubclass(cls, objectives.ActorObjective)
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    defaults = {p.name: p.default for p in parameters}
    assert selected["init_args"] == defaults


def test_there_is_one_objective_overlay_per_objective() -> None:
    selected = [
        yaml.safe_load(path.read_text())["model"]["actor_objective"]["class_path"]
        for path in OBJECTIVE_OVERLAYS
    ]
    exported = {
        f"brace_lightning.objectives.{name}"
        for name in objectives.__all__
        if isinstance(getattr(objectives, name), type)
        and issubclass(getattr(objectives, name), objectives.ActorObjective)
        and getattr(objectives, name) is not objectives.ActorObjective
    }
    assert sorted(selected) == sorted(exported)


def test_the_kl_overlay_sets_only_the_kl_arguments_and_composes_with_an_objective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert set((CONFIGS / "objectives").glob("*.yaml")) == {*OBJECTIVE_OVERLAYS, KL_OVERLAY}
    text = KL_OVERLAY.read_text()
    assert text.startswith("# Overlay: ")
    assert set(yaml.safe_load(text)) == {"model"}
    assert set(yaml.safe_load(text)["model"]) == {"kl_coef", "kl_estimator", "kl_mode"}
    config = parsed_config(
        monkeypatch, QUICKSTART, CONFIGS / "objectives" / "icepop.yaml", KL_OVERLAY
    )
    assert config["model"]["actor_objective"]["class_path"].endswith("IcePop")
    assert config["model"]["kl_coef"] > 0


def test_the_recommended_async_overlay_is_the_maps_fourth_candidate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """configs/async_recommended.yaml resolves, on the counting recipe with GAE, to exactly the
    configuration the lag x lr map ran as ``stable_budget_4e-4`` (its three overlays and the
    lr_budget override): the shipped file is the configuration that was measured."""
    from benchmarks import lm_staleness_map as lm_map

    recipe = (CONFIGS / "evidence" / "long_count.yaml", CONFIGS / "targets" / "gae.yaml")
    candidate = "stable_budget_4e-4"
    measured = parsed_config(
        monkeypatch, *recipe, *lm_map.CONFIGURATIONS[candidate], *lm_map.OVERRIDES[candidate]
    )
    shipped = parsed_config(monkeypatch, *recipe, CONFIGS / "async_recommended.yaml")
    assert shipped.pop("config") != measured.pop("config")  # the files named, not what they set
    assert shipped == measured
    assert shipped["model"]["actor_step_size"]["init_args"]["lr_budget"] == 4e-4
    assert shipped["model"]["value_target"]["init_args"]["rho_in_advantage"] is True
