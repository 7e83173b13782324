"""Imports go one way: every module of the package is read with ``ast`` and checked against its layer.

The layers, from the bottom (a module may import its own layer and the ones below it, never above):

0. shared utilities, plain Python: ``brace_lightning/__init__.py`` (the version), ``checks.py``
   (argument checks), ``seeds.py`` (the run seed);
1. pure math, no Lightning and no I/O: ``targets/``, ``objectives/``, ``sim/``;
2. stateful pieces that use no other stateful piece: ``tasks/`` (prompts, rewards, prompt
   encoding), ``metrics/`` and ``console.py`` (the quiet console, also used by the vLLM engine);
3. stateful pieces: ``models/`` (actor, critic, sharding);
4. stateful pieces: ``rollout/`` (engines and collection, on models and tasks);
5. orchestration: ``module.py``, ``data/`` and every other top-level module (``callbacks.py``,
   ``warmstart.py``, ``closed_loop.py``, ``step_metrics.py``, ``hparams.py``, ``export.py``,
   ``sweep.py``, ``cli_errors.py``, ...);
6. the command line: ``cli.py``.

DESIGN.md names three layers (pure math <- stateful pieces <- orchestration); 2-4 split the middle
one so that its arrows also go one way (a model never imports rollout code).
A package's ``__init__.py`` belongs to its package's layer. Every ``import`` statement counts,
also those inside functions and under ``if TYPE_CHECKING`` (a lazy import is still an arrow).
Imports by name at run time (``importlib.import_module``) are not seen.

Besides the direction, the import graph between the package's modules must have no circle, and the
pure-math layer imports no Lightning or torchmetrics (DESIGN.md: "pure layers import no Lightning").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "brace_lightning"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

LAYER_NAMES = (
    "shared utility",
    "pure math",
    "tasks/metrics",
    "models",
    "rollout",
    "orchestration",
    "command line",
)

#: First path part under ``brace_lightning/`` (a subpackage or a top-level file) -> layer.
LAYERS = {
    "__init__.py": 0,
    "checks.py": 0,
    "seeds.py": 0,
    "targets": 1,
    "objectives": 1,
    "sim": 1,
    "tasks": 2,
    "metrics": 2,
    "console.py": 2,
    "models": 3,
    "rollout": 4,
    "data": 5,
    "cli.py": 6,
}
ORCHESTRATION = 5
PURE_MATH = 1

#: Third-party packages the pure-math layer must not import.
NOT_PURE = ("lightning", "pytorch_lightning", "torchmetrics")


def layer_of(relative: Path) -> int:
    """The layer of a module given by its path under ``brace_lightning/``."""
    return LAYERS.get(relative.parts[0], ORCHESTRATION)


def module_name(relative: Path) -> str:
    """``models/critic.py`` -> ``brace_lightning.models.critic``; a package's ``__init__.py`` is
    the package."""
    parts = [PACKAGE, *relative.with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree: ast.Module, name: str, is_package: bool) -> list[tuple[int, str, str]]:
    """``(line, imported module, statement)`` for every import in ``tree``; ``from a import b``
    gives ``a.b`` (the caller keeps it when it is a module, else falls back to ``a``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: resolve against this module's package
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            statement = f"from {'.' * node.level}{node.module or ''} import " + ", ".join(
                alias.name for alias in node.names
            )
            for alias in node.names:
                found.append((node.lineno, f"{base}.{alias.name}", statement))
    return found


def import_graph(
    root: Path,
) -> tuple[
    dict[str, Path], dict[str, list[tuple[str, int, str]]], dict[str, list[tuple[int, str]]]
]:
    """The package under ``root`` as ``(module -> file, module -> [(imported module, line,
    statement)], module -> [(line, third-party top-level name)])``."""
    files = {module_name(path.relative_to(root)): path for path in sorted(root.rglob("*.py"))}
    edges: dict[str, list[tuple[str, int, str]]] = {}
    external: dict[str, list[tuple[int, str]]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges[name], external[name] = [], []
        for line, target, statement in imports_of(tree, name, path.name == "__init__.py"):
            top = target.split(".")[0]
            if top != PACKAGE:
                external[name].append((line, top))
                continue
            # ``from a import b``: b is a module of the package, or a name defined in a.
            while target not in files and "." in target:
                target = target.rpartition(".")[0]
            if target != name and all(t != target or n != line for t, n, _ in edges[name]):
                edges[name].append((target, line, statement))
    return files, edges, external


def upward_imports(root: Path) -> list[str]:
    """Every import from a lower layer to a higher one, one sentence each."""
    files, edges, _ = import_graph(root)
    found = []
    for name, targets in edges.items():
        here = layer_of(files[name].relative_to(root))
        for target, line, statement in targets:
            there = layer_of(files[target].relative_to(root))
            if there > here:
                found.append(
                    f"{files[name].relative_to(root.parent)}:{line} ({LAYER_NAMES[here]}) "
                    f"`{statement}` imports {target} ({LAYER_NAMES[there]})"
                )
    return found


def circles(root: Path) -> list[str]:
    """Import circles between the package's modules, one sentence each naming the imports that
    close it (searched from each module not already on a circle found)."""
    files, edges, _ = import_graph(root)
    # A module imports its parent packages' __init__ first; that is not an arrow of the code.
    graph = {
        name: {t: (line, s) for t, line, s in targets if not name.startswith(t + ".")}
        for name, targets in edges.items()
    }
    found = []
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        # Depth-first search for a path from start back to start.
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for target in sorted(graph[node]):
                if target == start:
                    loop = [*path, start]
                    done.update(loop)
                    steps = ", ".join(
                        f"{files[a].relative_to(root.parent)}:{graph[a][b][0]} `{graph[a][b][1]}`"
                        for a, b in zip(loop, loop[1:], strict=False)
                    )
                    found.append(f"circle {' -> '.join(loop)}: {steps}")
                    stack.clear()
                    break
                if target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    return found


def impure_imports(root: Path) -> list[str]:
    """Every import of Lightning or torchmetrics in the pure-math layer, one sentence each."""
    files, _, external = import_graph(root)
    return [
        f"{files[name].relative_to(root.parent)}:{line} (pure math) imports {top}"
        for name, found in external.items()
        if layer_of(files[name].relative_to(root)) == PURE_MATH
        for line, top in found
        if top in NOT_PURE
    ]


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    found = upward_imports(ROOT)
    assert not found, "imports that run back up:\n" + "\n".join(found)


def test_the_package_has_no_import_circle() -> None:
    found = circles(ROOT)
    assert not found, "import circles:\n" + "\n".join(found)


def test_pure_math_imports_no_lightning() -> None:
    found = impure_imports(ROOT)
    assert not found, "\n".join(found)


def test_every_subpackage_has_a_layer() -> None:
    """A new subpackage must be placed on purpose (the default, orchestration, is for files)."""
    unplaced = [
        path.name
        for path in ROOT.iterdir()
        if path.is_dir() and (path / "__init__.py").exists() and path.name not in LAYERS
    ]
    assert not unplaced, f"subpackages without a layer in LAYERS: {unplaced}"


def _package(tmp_path: Path, sources: dict[str, str]) -> Path:
    root = tmp_path / PACKAGE
    for relative, text in {"__init__.py": "", **sources}.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_names_a_planted_upward_import(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "targets/__init__.py": "",
            "targets/functional.py": "def f():\n    from brace_lightning.module import M\n",
            "models/__init__.py": "",
            "models/critic.py": "from brace_lightning.targets import functional as F\n",
            "module.py": "from brace_lightning.models.critic import x\n",
        },
    )
    assert upward_imports(root) == [
        "brace_lightning/targets/functional.py:2 (pure math) "
        "`from brace_lightning.module import M` imports brace_lightning.module (orchestration)"
    ]


def test_the_checker_names_a_planted_circle(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "models/__init__.py": "",
            "models/a.py": "from brace_lightning.models.b import x\n",
            "models/b.py": "def g():\n    from brace_lightning.models import a\n",
            "models/c.py": "from brace_lightning.models import a, b\n",
        },
    )
    found = circles(root)
    assert len(found) == 1
    assert found[0].startswith("circle brace_lightning.models.a -> brace_lightning.models.b ->")
    assert "brace_lightning/models/b.py:2 `from brace_lightning.models import a`" in found[0]


def test_the_checker_names_lightning_in_pure_math(tmp_path: Path) -> None:
    root = _package(tmp_path, {"sim/__init__.py": "import torchmetrics\nimport torch\n"})
    assert impure_imports(root) == [
        "brace_lightning/sim/__init__.py:1 (pure math) imports torchmetrics"
    ]


@pytest.mark.parametrize("relative", ["checks.py", "seeds.py", "__init__.py"])
def test_shared_utilities_import_nothing_of_the_package(relative: str) -> None:
    _, edges, _ = import_graph(ROOT)
    assert edges[module_name(Path(relative))] == []
