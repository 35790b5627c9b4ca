"""Every notebook in colabs/ runs top to bottom without error (each sized to stay under a
minute), in its quick variant: with LOWCOMM_NOTEBOOK_SMOKE=1 a notebook trains for fewer steps
(its `SMOKE`), every cell and code path the same."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

# The notebooks' kernels inherit the suite's environment (conftest.py): its compilation cache and
# XLA's faster CPU compile.
NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "colabs").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
  monkeypatch.setenv("LOWCOMM_NOTEBOOK_SMOKE", "1")  # the kernel inherits this environment
  notebook = nbformat.read(path, as_version=4)
  client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  errors = [o for cell in notebook.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors
