"""Real multi-process runs through jax.distributed (gloo on 127.0.0.1), started by launch_local.py.

Each process has one fake CPU device and owns whole replicas; the single-process reference
simulates the same replicas with vmap on one device. All-reduce order differs between the two
(gloo across processes, an XLA reduction inside one), so parameters agree to float32 rounding:
max abs difference below 1e-5 (measured: about 2e-7 after 8 steps of the tiny model). A run killed
and restarted is compared to the same uninterrupted multi-process run bit for bit.
"""

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from lowcomm_jax import config as config_lib
from lowcomm_jax.train import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "experiments" / "launch_local.py"
CONFIGS = ROOT / "experiments" / "configs"
TOLERANCE = 1e-5

COMMON = {"model.size": "tiny", "num_steps": 8, "diloco.sync_every": 4, "data.seq_len": 32,
          "data.batch_size": 4, "eval.batch_size": 4, "eval.num_batches": 1, "eval.every": 1000,
          "checkpoint.every": 1000, "log_every": 1, "progress_bar": False,
          "hardware.peak_flops_per_device": 1e10, "distributed.timeout_seconds": 20}
NOLOCO = {"noloco.sync_every": 4, "noloco.group_size": 2}
STREAMING = {"algorithm": "streaming_diloco", "diloco.num_fragments": 2,
             "diloco.non_block_fragment": "fold", "diloco.overlap_steps": 1,
             "diloco.merge_alpha": 0.5, "num_steps": 12}


def make_config(config_file: str, changes: dict):
  spec = importlib.util.spec_from_file_location("experiment_config", CONFIGS / config_file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return config_lib.override(module.get_config("tiny"), changes)


def launch(num_processes: int, workdir, changes: dict, on_line=None,
           config_file: str = "diloco.py") -> subprocess.CompletedProcess:
  """Runs launch_local.py to the end; `on_line(line, popen)` sees each line of its stdout."""
  command = [sys.executable, str(LAUNCHER), f"--num_processes={num_processes}", "--",
             f"--config={CONFIGS / config_file}:tiny", f"--workdir={workdir}",
             *(f"--config.{k}={v}" for k, v in changes.items())]
  popen = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ))
  stderr = []
  pump = threading.Thread(target=lambda: stderr.extend(popen.stderr), daemon=True)
  pump.start()
  stdout = []
  for line in popen.stdout:
    stdout.append(line)
    if on_line:
      on_line(line, popen)
  popen.wait(timeout=240)
  pump.join(timeout=10)
  return subprocess.CompletedProcess(command, popen.returncode, "".join(stdout), "".join(stderr))


def multiprocess_changes(num_processes: int, changes: dict) -> dict:
  return {**COMMON, "num_replicas": num_processes, "mesh.replica": num_processes, **changes}


def restored(workdir):
  """The final train state of a run directory, read back from its orbax checkpoint."""
  return Trainer(config_lib.load_run_config(workdir), workdir).restore_latest()


def max_abs_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def single_process(tmp_path, num_replicas: int, changes: dict, config_file: str = "diloco.py"):
  c = make_config(config_file, {**COMMON, "num_replicas": num_replicas, "mesh.replica": 1, "mesh.data": 1,
                   **changes})
  trainer = Trainer(c, tmp_path / f"single{num_replicas}", devices=jax.devices()[:1])
  trainer.run()
  return trainer.final_state


@pytest.fixture(scope="module")
def streaming_two_processes(tmp_path_factory):
  """An uninterrupted 2-process Streaming DiLoCo run (P=2, τ=1, α=0.5), shared by two tests."""
  workdir = tmp_path_factory.mktemp("streaming2") / "run"
  proc = launch(2, workdir, multiprocess_changes(2, STREAMING))  # one checkpoint: the last step
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir


@pytest.mark.parametrize("config_file,num_processes,changes", [
    ("diloco.py", 2, {}), ("diloco.py", 4, {}), ("noloco.py", 2, NOLOCO)])
def test_processes_match_the_single_process_simulation(tmp_path, config_file, num_processes, changes):
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


def test_streaming_diloco_two_processes_match_the_single_process_simulation(
    tmp_path, streaming_two_processes):
  reference = single_process(tmp_path, 2, STREAMING)
  diff = max_abs_diff(restored(streaming_two_processes), reference)
  print(f"streaming diloco, 2 processes vs single process: max abs diff {diff:.3g}")
  assert diff < TOLERANCE


def test_sigkill_mid_round_then_restart_ends_with_the_uninterrupted_parameters(
    tmp_path, streaming_two_processes):
  workdir = tmp_path / "killed"
  metrics = workdir / "metrics.jsonl"
  pids, killed = {}, []

  def kill_process_1_after_step_7(line, popen):
    if line.startswith("launch_local: process"):
      index, pid = line.split()[2], int(line.split()[-1])
      pids[int(index)] = pid
    if killed or not metrics.exists():
      return
    steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines() if l.endswith("}")]
    if steps and steps[-1] >= 7:  # after the checkpoint of step 6, in the round ending at step 8
      os.kill(pids[1], signal.SIGSTOP)  # frozen wherever it is, then killed there
      os.kill(pids[1], signal.SIGKILL)
      killed.append(steps[-1])

  changes = multiprocess_changes(2, {**STREAMING, "checkpoint.every": 3})  # a runtime key
  crashed = launch(2, workdir, changes, kill_process_1_after_step_7)
  assert killed, "the run ended before process 1 could be killed"
  assert crashed.returncode == 128 + signal.SIGKILL
  assert f"process 1 (pid {pids[1]}) failed: killed by signal SIGKILL" in crashed.stderr
  assert "--- process 0, ended with" in crashed.stderr
  assert crashed.stderr.split("--- process 0")[1].split("--- process 1")[0].count("\n[0] ") >= 5
  assert not (workdir / "summary.json").exists()
  # Saves are asynchronous: the one of step 6 may still have been in flight, and is then not used.
  last_complete = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert last_complete in (3, 6)

  resumed = launch(2, workdir, changes)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"[0] resumed from {workdir.absolute()}/checkpoints/{last_complete}" in resumed.stdout
  assert f"[1] resumed from {workdir.absolute()}/checkpoints/{last_complete}" in resumed.stdout
  diff = max_abs_diff(restored(workdir), restored(streaming_two_processes))
  print(f"killed at step {killed[0]}, resumed from {last_complete}: max abs diff {diff}")
  assert diff == 0.0
  steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines()]
  assert steps == list(range(1, 13))


def test_launcher_reports_a_failed_process_with_its_status_and_last_lines(tmp_path):
  proc = launch(2, tmp_path / "bad", {"num_steps": 0})
  assert proc.returncode == 1
  assert "failed: exit status 1; the others were stopped" in proc.stderr
  assert "num_steps must be >= 1, got 0" in proc.stderr
  assert not (tmp_path / "bad").exists()
