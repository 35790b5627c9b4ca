"""Faults in real multi-process runs: SIGKILL mid-round then a restart, SIGTERM (a preemption
notice) then a restart, a frozen process, a crash reported by the launcher; and what the processes
listen on. The restarted runs are compared bit for bit to the same uninterrupted 2-process Streaming
DiLoCo run, which is itself compared to the single-process simulation."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from lowcomm_jax.testing import (
  CONFIGS,
  ROOT,
  STREAMING,
  TOLERANCE,
  launch,
  listening_addresses,
  max_abs_diff,
  multiprocess_changes,
  restored,
  run_streaming_two_processes,
  single_process,
)
from lowcomm_jax.train import checkpoint, workdir as workdir_lib


@pytest.fixture(scope="module")
def streaming_two_processes(tmp_path_factory):
  """The uninterrupted run that two tests compare to."""
  workdir = tmp_path_factory.mktemp("streaming2") / "run"
  run_streaming_two_processes(workdir)
  return workdir


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
  # Saves are asynchronous: the one of step 6 may still have been in flight (or not yet sealed by
  # its checksum), and is then not used.
  last_complete = max(int(p.name) for p in (workdir / "checkpoints").iterdir()
                      if p.name.isdigit() and (p / checkpoint.CHECKSUM_FILE).exists())
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


def test_sigterm_to_one_process_saves_one_agreed_step_and_the_rerun_resumes_bit_identically(
    tmp_path, streaming_two_processes):
  workdir = tmp_path / "preempted"
  pids, sent, listening = {}, [], []

  def sigterm_process_1_after_step_2(line, popen):
    if line.startswith("launch_local: process"):
      pids[int(line.split()[2])] = int(line.split()[-1])
    if not sent and line.startswith("[0] step 2:"):  # early: later steps take milliseconds
      listening.extend(a for pid in pids.values() for a in listening_addresses(pid))
      # process 0 held (SIGSTOP) while process 1 gets the SIGTERM, so the run cannot end before
      # the processes agree on it (every step's agreement waits for process 0)
      os.kill(pids[0], signal.SIGSTOP)
      os.kill(pids[1], signal.SIGTERM)  # what SLURM or Kubernetes sends before a kill
      time.sleep(0.2)
      os.kill(pids[0], signal.SIGCONT)
      sent.append(True)

  changes = multiprocess_changes(2, STREAMING)  # checkpoint.every=1000: only the preemption saves
  stopped = launch(2, workdir, changes, sigterm_process_1_after_step_2)
  assert sent, "the run ended before process 1 got its SIGTERM"
  assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
  assert "launch_local: SIGTERM: all 2 processes saved a checkpoint and stopped" in stopped.stderr
  saved = re.findall(r"\[(\d)\] SIGTERM received: stopped after saving the checkpoint of step "
                     r"(\d+)",
                     stopped.stdout)
  assert sorted(index for index, _ in saved) == ["0", "1"]
  assert len({step for _, step in saved}) == 1, saved  # both processes saved the same step
  step = int(saved[0][1])
  assert 2 <= step < 12
  assert [p.name for p in (workdir / "checkpoints").iterdir()] == [str(step)]
  checkpoint.verify(workdir / "checkpoints" / str(step))  # sealed: complete and intact
  assert not (workdir / "summary.json").exists()

  # The coordinator listens on the launcher's 127.0.0.1 only, and nothing else listens elsewhere.
  port = int(re.search(r"coordinator at 127\.0\.0\.1:(\d+)", stopped.stdout).group(1))
  print(f"listening sockets of the two processes: {listening}")
  assert port in [p for _, p in listening]
  assert listening and all(address.is_loopback for address, _ in listening)

  resumed = launch(2, workdir, changes)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  for index in (0, 1):
    assert f"[{index}] resumed from {workdir.absolute()}/checkpoints/{step}" in resumed.stdout
  diff = max_abs_diff(restored(workdir), restored(streaming_two_processes))
  print(f"SIGTERM after step 2, saved at step {step}, resumed: max abs diff {diff}")
  assert diff == 0.0
  steps = [json.loads(l)["step"] for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps == list(range(1, 13))


def test_a_process_that_stops_answering_stops_the_others_naming_it(tmp_path):
  timeout = 5  # distributed.timeout_seconds: JAX's heartbeat timeout
  pids, frozen_at = {}, []

  def freeze_process_1_after_step_1(line, popen):
    if line.startswith("launch_local: process"):
      pids[int(line.split()[2])] = int(line.split()[-1])
    if not frozen_at and line.startswith("[0] step 1:"):
      os.kill(pids[1], signal.SIGSTOP)  # alive but silent, as a hung host or a stuck NIC
      frozen_at.append(time.monotonic())

  proc = launch(2, tmp_path / "run", multiprocess_changes(
      2, {"distributed.timeout_seconds": timeout}), freeze_process_1_after_step_1)
  elapsed = time.monotonic() - frozen_at[0]
  print(f"process 1 frozen: the launcher exited {elapsed:.1f} s later")
  assert proc.returncode != 0
  first_line = proc.stderr[proc.stderr.index("launch_local:"):].splitlines()[0]
  assert first_line.startswith("launch_local: process 1 stopped answering: no heartbeat within")
  # the heartbeat's detection stopped process 0 (SIGABRT), then the launcher the run: no wait
  # without an end (a hang fails at the tier's timeout, tests/conftest.py)
  assert "(process 0 (pid" in first_line and "failed: killed by signal SIGABRT" in first_line


def test_launcher_reports_a_failed_process_with_its_status_and_last_lines(tmp_path):
  # The replica axis must span the processes: refused in every process before anything is written.
  proc = launch(2, tmp_path / "bad", multiprocess_changes(2, {"mesh.replica": 1}))
  assert proc.returncode == 1
  assert "failed: exit status 1; the others were stopped" in proc.stderr
  assert ("ValueError: mesh.replica=1 must be a multiple of the 2 processes (the replica axis "
          "spans processes") in proc.stderr
  assert "Traceback" not in proc.stderr  # a refused start is one line per process
  assert not (tmp_path / "bad").exists()


def test_a_second_start_on_a_workdir_in_use_is_refused_naming_the_first(tmp_path):
  workdir, lock = tmp_path / "run", tmp_path / "run" / workdir_lib.LOCK_FILE
  command = [sys.executable, str(ROOT / "experiments" / "train.py"),
             f"--config={CONFIGS / 'dp.py'}:tiny",
             f"--workdir={workdir}", "--config.num_steps=4", "--config.log_every=1",
             "--config.eval.every=4", "--config.progress_bar=False"]
  first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 240
    while f"pid {first.pid} " not in (lock.read_text() if lock.exists() else ""):
      assert first.poll() is None and time.monotonic() < deadline, "the first start never locked"
      time.sleep(0.01)
    os.kill(first.pid, signal.SIGSTOP)  # holding the workdir, wherever it is in its run
    try:
      second = subprocess.run(command, capture_output=True, text=True, timeout=240)
    finally:
      os.kill(first.pid, signal.SIGCONT)
    _, first_err = first.communicate(timeout=240)
  finally:
    if first.poll() is None:
      first.kill()
  assert second.returncode == 1, second.stderr[-2000:]
  assert second.stderr.startswith(
      f"ValueError: workdir {workdir} is in use by another run (pid {first.pid} on host "
      f"{socket.gethostname()}, which holds {lock})"), second.stderr[-2000:]
  assert "Traceback" not in second.stderr
  assert first.returncode == 0, first_err[-2000:]
  steps = [json.loads(l)["step"] for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4]  # each step logged once: the second start wrote nothing
  assert json.loads((workdir / "summary.json").read_text())["steps"] == 4


def test_every_process_of_a_run_refuses_a_workdir_another_start_holds(tmp_path):
  holder = workdir_lib.RunLock(tmp_path / "run")  # this process: a start that holds the workdir
  try:
    proc = launch(2, tmp_path / "run", multiprocess_changes(2, {}))
  finally:
    holder.release()
  assert proc.returncode == 1
  refusal = f"is in use by another run (pid {os.getpid()} on host {socket.gethostname()}"
  assert "failed: exit status 1" in proc.stderr and refusal in proc.stderr, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  assert [p.name for p in (tmp_path / "run").iterdir()] == [workdir_lib.LOCK_FILE]
