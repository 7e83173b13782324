"""Execute the tutorial notebooks in place so that the committed .ipynb files show their outputs
and plots (``tests/test_tutorials.py`` re-executes them and checks them against their .py sources,
ignoring outputs).

    .venv/bin/python scripts/execute_tutorials.py              # every tutorial
    .venv/bin/python scripts/execute_tutorials.py 01 03        # the ones whose name starts so

Each notebook runs in a temporary working directory (its runs and checkpoints are not kept).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", help="run only notebooks starting with these")
    args = parser.parse_args(argv)
    notebooks = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
    if args.prefixes:
        notebooks = [p for p in notebooks if p.name.startswith(tuple(args.prefixes))]
        if not notebooks:
            parser.error(f"no tutorial starts with {args.prefixes}; expected e.g. 00 or 01_stale")
    for path in notebooks:
        notebook = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as work:
            NotebookClient(
                notebook,
                timeout=1800,
                kernel_name="python3",
                resources={"metadata": {"path": work}},
            ).execute()
        nbformat.write(notebook, path)
        print(f"{path.name}: executed in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
