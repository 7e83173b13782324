"""``python -m benchmarks._follow MODULE [ARGS...]``: run ``MODULE`` as ``__main__`` with ``ARGS``
and stop it once the process that started it is gone.

The grid harnesses start every fit through it (:func:`benchmarks._common.cli_command`). Without
it, a harness killed by a signal left its running fit behind: the fit went on writing into a cell
that has no ``done.json`` marker yet, so the rerun of the harness started the same cell a second
time beside it. The parent is this process's parent at start (the process that called
``subprocess.run``, on whichever machine), watched by
:func:`benchmarks._common.stop_with_parent`: SIGTERM, which Lightning turns into a stop at the
next batch, then an exit after a grace period.
"""

from __future__ import annotations

import os
import runpy
import sys

from benchmarks._common import stop_with_parent


def main(argv: list[str]) -> None:
    """Watch the parent, then run ``argv[0]`` as ``python -m argv[0] argv[1:]`` would."""
    if not argv:
        raise SystemExit(
            "benchmarks._follow takes the module to run and its arguments "
            "(python -m benchmarks._follow MODULE [ARGS...]); got no module."
        )
    stop_with_parent(os.getppid())
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
