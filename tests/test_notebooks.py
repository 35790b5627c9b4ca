"""Every notebook in colabs/ runs top to bottom without error (each sized to stay under a
minute), in its quick variant: with LOWCOMM_NOTEBOOK_SMOKE=1 a notebook trains for fewer steps
(its `SMOKE`), every cell and code path the same."""

import os
import pathlib
from importlib import metadata

import nbformat
import pytest
from nbclient import NotebookClient

# The notebooks' kernels compile with XLA's CPU elemental emitters instead of its fusion emitters
# where the flag exists (jaxlib 0.10; a later XLA has none and an unknown XLA flag is fatal): a
# third less CPU for their compiles. A notebook asserts no rounding-level equality between two
# programs, which the emitters may round differently (the other tests keep XLA's default).
FAST_COMPILE = (" --xla_cpu_use_fusion_emitters=false"
                if metadata.version("jaxlib").startswith("0.10.") else "")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "colabs").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
  monkeypatch.setenv("LOWCOMM_NOTEBOOK_SMOKE", "1")  # the kernel inherits this environment
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + FAST_COMPILE)
  notebook = nbformat.read(path, as_version=4)
  client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  errors = [o for cell in notebook.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "error"]
  assert not errors
