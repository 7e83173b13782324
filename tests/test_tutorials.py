"""The tutorials are real notebooks: each .ipynb matches its jupytext .py source and executes."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
SOURCES = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))


def test_there_are_tutorials():
    assert [p.stem for p in SOURCES][:1] == ["00_quickstart"]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_matches_its_source(source):
    notebook = source.with_suffix(".ipynb")
    assert notebook.exists(), f"{notebook.name} is missing: run `jupytext --sync {source.name}`"
    from_source = jupytext.read(source)
    committed = jupytext.read(notebook)
    assert [c.source for c in committed.cells] == [c.source for c in from_source.cells], (
        f"{notebook.name} is out of date with {source.name}: run `jupytext --sync {source.name}`"
    )


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_executes(source, tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors
