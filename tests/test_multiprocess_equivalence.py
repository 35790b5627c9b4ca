"""Real multi-process runs of the train.py binary through jax.distributed (gloo on 127.0.0.1) equal
the single-process simulation: DiLoCo with 4 processes (one replica each). Two processes for every
algorithm, in one launch, are the battery's leg
(tests/test_engine.py::test_two_processes_equal_one); Streaming DiLoCo's 2-process binary run is
checked in test_multiprocess_faults.py, next to its kill-restart twin."""

import json

import pytest

from lowcomm_jax.testing import (
  TOLERANCE,
  launch,
  max_abs_diff,
  multiprocess_changes,
  restored,
  single_process,
)


@pytest.mark.parametrize("config_file,num_processes,changes", [("diloco.py", 4, {})])
def test_processes_match_the_single_process_simulation(tmp_path, config_file, num_processes,
                                                       changes):
  proc = launch(num_processes, tmp_path / "multi", multiprocess_changes(num_processes, changes),
                config_file=config_file)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"launch_local: all {num_processes} processes finished" in proc.stdout
  # Only process 0 writes the run's files; every process wrote its shard of the checkpoint.
  assert "[0] summary:" in proc.stdout and "[1] summary:" not in proc.stdout
  summary = json.loads((tmp_path / "multi" / "summary.json").read_text())
  assert summary["mesh"]["replica"] == num_processes and summary["steps"] == 8
  reference = single_process(tmp_path, num_processes, changes, config_file)
  diff = max_abs_diff(restored(tmp_path / "multi"), reference)
  print(f"{config_file}, {num_processes} processes vs single process: max abs diff {diff:.3g}")
  assert diff < TOLERANCE
