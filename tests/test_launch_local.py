"""experiments/launch_local.py: its processes die with it (SIGKILL included), and each can be given
its own GPUs."""

import os
import signal
import subprocess
import sys
import time

import pytest
from absl import app

from lowcomm_jax import testing
from lowcomm_jax.testing import ROOT

launch_local = testing.launcher_module()

# A worker that ignores its flags, says it runs, and waits forever (the default SIGTERM ends it).
_WORKER = "import time\nprint('ready', flush=True)\nwhile True:\n  time.sleep(1)\n"


def _gone(pid: int) -> bool:
  """Ended (a zombie left for a parent that does not reap counts as ended)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except FileNotFoundError:
    return True


# How long an orphan may take to go (the watchdog's 5 s grace and its polls): the wait ends as soon
# as it has gone, so the bound only has to be one that a loaded machine never reaches.
ORPHAN_WAIT_S = 120


def _wait_gone(pids, seconds: float) -> float:
  start = time.monotonic()
  while not all(map(_gone, pids)) and time.monotonic() - start < seconds:
    time.sleep(0.1)
  return time.monotonic() - start


def _kill_all(pids):
  for pid in pids:
    if not _gone(pid):
      os.kill(pid, signal.SIGKILL)


def test_processes_die_when_the_launcher_is_killed(tmp_path):
  worker = tmp_path / "worker.py"
  worker.write_text(_WORKER)
  launcher = subprocess.Popen(
      [sys.executable, str(ROOT / "experiments" / "launch_local.py"), "--num_processes=2",
       f"--script={worker}", "--", "--unused"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)
  pids, ready = [], 0
  try:
    for line in launcher.stdout:
      if line.startswith("launch_local: process"):
        pids.append(int(line.split()[-1]))
      ready += line.rstrip().endswith("] ready")
      if ready == 2:
        break
    assert len(pids) == 2 and ready == 2
    launcher.kill()
    launcher.wait(timeout=30)
    waited = _wait_gone(pids, ORPHAN_WAIT_S)
    assert all(map(_gone, pids)), (
      f"workers {pids} still alive {waited:.1f} s after the launcher's SIGKILL"
    )
  finally:
    _kill_all(pids)
    launcher.kill()


# A parent that starts a worker and one of the launcher's two guards: the watchdog alone (as on a
# system without a parent-death signal), or the parent-death signal alone.
_PARENT = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import launch_local
worker, guard = [sys.executable, "-c", sys.argv[2]], sys.argv[3]
if guard == "signal":
  worker = launch_local.die_with_launcher(worker)
worker = subprocess.Popen(worker, stdout=subprocess.DEVNULL)
if guard == "watchdog":
  launch_local.start_watchdog([worker.pid], grace_seconds=5.0)
print(worker.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("guard", ["watchdog", "signal"])
def test_each_guard_alone_stops_the_orphans(guard):
  parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(ROOT / "experiments"), _WORKER,
                             guard],
                            stdout=subprocess.PIPE, text=True)
  pid = None
  try:
    pid = int(parent.stdout.readline())
    time.sleep(0.5)
    assert not _gone(pid)
    parent.kill()
    parent.wait(timeout=30)
    _wait_gone([pid], ORPHAN_WAIT_S)
    assert _gone(pid), f"the worker outlived its parent by {ORPHAN_WAIT_S} s with the {guard} alone"
  finally:
    if pid is not None:
      _kill_all([pid])
    parent.kill()


def test_each_process_gets_its_block_of_gpus():
  assert launch_local.split_gpus("0,1,2,3", 4) == ["0", "1", "2", "3"]
  assert launch_local.split_gpus("4,5,6,7", 2) == ["4,5", "6,7"]
  env = launch_local.child_env(1, "6,7")
  assert (env["CUDA_VISIBLE_DEVICES"], env["JAX_PLATFORMS"]) == ("6,7", "cuda")
  assert "xla_force_host_platform_device_count" not in env["XLA_FLAGS"]
  cpu = launch_local.child_env(3)
  assert cpu["JAX_PLATFORMS"] == "cpu" and cpu["XLA_FLAGS"].endswith(
      "--xla_force_host_platform_device_count=3")


@pytest.mark.parametrize("gpus,processes,message", [
    ("0,1,2", 2, "--gpus gives 3 GPUs, which do not split equally among --num_processes=2"),
    ("0,0", 2, "--gpus must be distinct CUDA device ids"),
    ("gpu0", 1, "--gpus must be distinct CUDA device ids"),
    ("", 1, "--gpus must be distinct CUDA device ids"),
])
def test_bad_gpu_lists_are_named(gpus, processes, message):
  with pytest.raises(app.UsageError, match=message):
    launch_local.split_gpus(gpus, processes)
