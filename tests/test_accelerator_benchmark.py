"""benchmarks/accelerator.py writes accelerator figures only: on CPU it runs with --smoke alone, and
never into benchmarks/results/accelerator.json."""

import subprocess
import sys

import pytest

from lowcomm_jax.testing import ROOT


@pytest.mark.parametrize("flags,line", [
    ([], "benchmarks/accelerator.py measures GPUs and TPUs; on CPU run it with --smoke"),
    (["--smoke", f"--out={ROOT / 'benchmarks' / 'results' / 'accelerator.json'}"],
     "--out: " + str(ROOT / "benchmarks" / "results" / "accelerator.json") + " holds accelerator "
     "figures only, not --smoke or CPU ones"),
])
def test_cpu_figures_are_never_written_as_accelerator_results(flags, line):
  results = ROOT / "benchmarks" / "results" / "accelerator.json"
  before = results.read_bytes() if results.exists() else None
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "accelerator.py"), *flags],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-2000:]
  assert (results.read_bytes() if results.exists() else None) == before
