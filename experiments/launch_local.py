"""Runs experiments/train.py as N processes on this machine, joined by jax.distributed on 127.0.0.1.

Process 0's coordinator listens on 127.0.0.1 only (train.py binds it to the coordinator address's
host unless --coordinator_bind_address is given).

  python experiments/launch_local.py --num_processes=2 -- \
      --config=experiments/configs/diloco.py:tiny --workdir=runs/diloco_2proc \
      --config.mesh.replica=2

Everything after `--` goes to every process unchanged (`--script` runs another script than train.py,
e.g. tests/engine_processes_worker.py); the launcher adds --coordinator_address
(127.0.0.1 and a free port), --num_processes and --process_id, and gives each process
--devices_per_process fake CPU devices, or, with --gpus, its share of this machine's GPUs
(CUDA_VISIBLE_DEVICES): one process per GPU of four, each a replica,

  python experiments/launch_local.py --num_processes=4 --gpus=0,1,2,3 -- \
      --config=experiments/configs/diloco.py --workdir=runs/diloco_4gpu --config.mesh.replica=4
 Their output is streamed with a `[i]` prefix. When one
process fails, the others are stopped at once and the launcher prints which process failed with
its exit status, then every process's last lines, and exits non-zero (the failed process's code, or
128 + its signal). Rerunning the same command resumes from the last complete checkpoint.

A SIGTERM to one process (or to the launcher, which passes it on) is a preemption notice: every
process saves the checkpoint of one agreed step and exits with status 143; the launcher then says
so and exits 143. Rerunning the command resumes from that checkpoint.

The processes die with the launcher: each gets SIGTERM when it ends, even by SIGKILL (Linux's
parent-death signal), and a watchdog process does the same on any system (SIGKILL for those still
running 120 s later), so no orphan holds the workdir.

This is a stand-in for a cluster scheduler on one machine (tests, debugging); on real clusters
every host runs train.py itself (README, "Multi-host").
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from lowcomm_jax import cli

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes to start (>= 1).")
_DEVICES = flags.DEFINE_integer("devices_per_process", 1, "Fake CPU devices in each process.")
_GPUS = flags.DEFINE_string(
    "gpus", None,
    "Comma-separated CUDA device ids of this machine to split among the processes, in "
    "order and equally (e.g. 0,1,2,3 with --num_processes=2: 0,1 and 2,3); unset: CPU processes.")
_TAIL = flags.DEFINE_integer("tail_lines", 20, "Lines of each process shown when one fails.")
_TRAIN = pathlib.Path(__file__).resolve().parent / "train.py"
_SCRIPT = flags.DEFINE_string(
    "script", str(_TRAIN), "The Python script every process runs (train.py; a test's worker). It "
    "must take --coordinator_address, --num_processes and --process_id.")
_STACK_FRAME = re.compile(r"\s+@\s+0x[0-9a-f]+ ")
# How JAX's runtime names a process that missed its heartbeats (distributed.timeout_seconds).
_SILENT = re.compile(r"Task (\d+) heartbeat timeout|stopped sending heartbeats\):\s*(\d+)")


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(devices: int, gpus: str | None = None) -> dict:
  """A process's environment: `devices` fake CPU devices, or the CUDA devices `gpus` ("0,1")."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  xla_flags = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")
  ).strip()
  if gpus is None:
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={devices}".strip()
    return env
  env.update(JAX_PLATFORMS="cuda", CUDA_VISIBLE_DEVICES=gpus, XLA_FLAGS=xla_flags)
  env.pop("JAX_LOCAL_DEVICE_IDS", None)  # each process uses every GPU it sees
  return env


def split_gpus(gpus: str, num_processes: int) -> list[str]:
  """Each process's CUDA_VISIBLE_DEVICES: `gpus` ("0,1,2,3") in order, in equal blocks.

  Raises:
    app.UsageError: naming --gpus, when the ids are not distinct integers >= 0 or do not split
    equally among the processes.
  """
  ids = [i.strip() for i in gpus.split(",")]
  if not all(i.isdigit() for i in ids) or len(set(ids)) != len(ids):
    raise app.UsageError(f"--gpus must be distinct CUDA device ids separated by commas, e.g. "
                         f"0,1,2,3, got {gpus!r}")
  if len(ids) % num_processes:
    raise app.UsageError(f"--gpus gives {len(ids)} GPUs, which do not split equally among "
                         f"--num_processes={num_processes}")
  per = len(ids) // num_processes
  return [",".join(ids[i * per:(i + 1) * per]) for i in range(num_processes)]


# Runs a command (argv[2:]) as this same process (exec) after asking Linux for SIGTERM when the
# launcher (pid argv[1]) ends: prctl(PR_SET_PDEATHSIG) survives the exec. A launcher already gone
# by then means SIGTERM now. Done in the child rather than in a preexec_fn, which is not safe while
# the launcher's output threads run.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG (linux/prctl.h)
if os.getppid() != int(sys.argv[1]):
  os.kill(os.getpid(), signal.SIGTERM)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_launcher(command: list[str]) -> list[str]:
  """`command`, made to get SIGTERM when this process ends, SIGKILL included (Linux; elsewhere
  unchanged, and the watchdog alone stops it)."""
  if not sys.platform.startswith("linux"):
    return command
  return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


# The watchdog: a separate process, so it outlives a launcher killed by SIGKILL. It polls its
# parent (the launcher) and, once the launcher is gone, stops the children as stop_all would.
_WATCHDOG = """
import os, signal, sys, time
launcher, grace, pids = int(sys.argv[1]), float(sys.argv[2]), [int(p) for p in sys.argv[3:]]
def alive(pid):  # a zombie (ended, not yet reaped) is not alive
  if os.path.isdir("/proc"):
    try:
      with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
      return False
  try:
    os.kill(pid, 0)
    return True
  except OSError:
    return False
def signal_all(signum):
  for pid in pids:
    try:
      os.kill(pid, signum)
    except OSError:
      pass
while os.getppid() == launcher and any(map(alive, pids)):
  time.sleep(0.25)
if any(map(alive, pids)):
  signal_all(signal.SIGTERM); signal_all(signal.SIGCONT)
  deadline = time.monotonic() + grace
  while any(map(alive, pids)) and time.monotonic() < deadline:
    time.sleep(0.25)
  signal_all(signal.SIGKILL)
"""


def start_watchdog(pids: list[int], grace_seconds: float) -> subprocess.Popen:
  """A process that stops `pids` (SIGTERM, SIGKILL after `grace_seconds`) once this one ends."""
  return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(grace_seconds),
                           *map(str, pids)], stdin=subprocess.DEVNULL, start_new_session=True)


def silent_processes(lines) -> list[int]:
  """Process ids the runtime reported as no longer sending heartbeats, in the given lines."""
  found = _SILENT.findall("\n".join(lines))
  return sorted({int(a or b) for a, b in found})


def describe(returncode: int | None) -> str:
  if returncode is None:
    return "still running"
  if returncode < 0:
    return f"killed by signal {signal.Signals(-returncode).name}"
  return f"exit status {returncode}"


class Process:
  """One child and a thread that prints its lines with a prefix and keeps the last few."""

  def __init__(self, index: int, command: list[str], env: dict, tail: int, lock: threading.Lock):
    self.index, self.lock = index, lock
    self.lines = collections.deque(maxlen=tail)
    self.silent_peers: set[int] = set()  # processes this one's runtime reported without heartbeat
    self.popen = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, errors="replace")
    self.thread = threading.Thread(target=self._pump, daemon=True)
    self.thread.start()

  def _pump(self) -> None:
    previous = ""
    for line in self.popen.stdout:
      line = line.rstrip("\n")
      # the id may follow on a new line
      self.silent_peers.update(silent_processes([previous, line]))
      previous = line
      if not _STACK_FRAME.match(line):  # C++ stack frames would push the telling lines out
        self.lines.append(line)
      with self.lock:
        print(f"[{self.index}] {line}", flush=True)


# Grace for children the launcher stops because it got SIGTERM itself: they save a checkpoint first.
_PREEMPTION_GRACE_SECONDS = 120.0
_PREEMPTED = 128 + signal.SIGTERM  # lowcomm_jax.distributed.PREEMPTED_EXIT_CODE


def wait_all(processes: list[Process], seconds: float) -> None:
  """Waits up to `seconds` for every child to end by itself."""
  deadline = time.monotonic() + seconds
  for p in processes:
    try:
      p.popen.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      return


def stop_all(processes: list[Process], grace_seconds: float = 5.0) -> None:
  """SIGTERM to every running child, SIGKILL to those still running after the grace period."""
  for p in processes:
    if p.popen.poll() is None:
      p.popen.send_signal(signal.SIGTERM)
      p.popen.send_signal(signal.SIGCONT)  # a frozen process gets its SIGTERM now
  deadline = time.monotonic() + grace_seconds
  for p in processes:
    try:
      p.popen.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.popen.kill()
      p.popen.wait()
  for p in processes:
    p.thread.join(timeout=5)


def launch(num_processes: int, devices: int, train_args: list[str], tail: int,
           coordinator_host: str = "127.0.0.1", wrap=lambda index, command: command,
           script=_TRAIN, gpus: str | None = None) -> int:
  """Runs `script` (train.py) as the processes, to the end; returns 0, or the failed process's
  code (128 + signal).

  `wrap(i, command)` may prefix process i's command (benchmarks/slow_link.py runs each process in
  its own network namespace, where process 0's coordinator listens on `coordinator_host`).
  `gpus`: CUDA device ids split among the processes (`split_gpus`); None: `devices` CPU devices.
  """
  address = f"{coordinator_host}:{free_port()}"
  lock, processes, grace, watchdog = threading.Lock(), [], 5.0, None
  blocks = split_gpus(gpus, num_processes) if gpus is not None else [None] * num_processes
  print(f"launch_local: coordinator at {address}", flush=True)
  try:
    for i in range(num_processes):
      command = [sys.executable, str(script), *train_args, f"--coordinator_address={address}",
                 f"--num_processes={num_processes}", f"--process_id={i}"]
      processes.append(Process(i, die_with_launcher(wrap(i, command)),
                               child_env(devices, blocks[i]),
                               tail, lock))
      with lock:
        gpu_note = f" on GPU {blocks[i]}" if blocks[i] is not None else ""
        print(f"launch_local: process {i} is pid {processes[-1].popen.pid}{gpu_note}", flush=True)
    watchdog = start_watchdog([p.popen.pid for p in processes], _PREEMPTION_GRACE_SECONDS)
    failed = None
    while failed is None and any(p.popen.poll() is None for p in processes):
      failed = next((p for p in processes if p.popen.poll() not in (None, 0)), None)
      time.sleep(0.05)
    failed = failed or next((p for p in processes if p.popen.returncode != 0), None)
    if failed is not None and failed.popen.returncode == _PREEMPTED:
      wait_all(processes, _PREEMPTION_GRACE_SECONDS)  # the others save the same step: let them
  except SystemExit:  # the launcher got SIGTERM: pass it on, and give the save its time
    grace = _PREEMPTION_GRACE_SECONDS
    raise
  finally:
    stop_all(processes, grace)
    if watchdog is not None:
      watchdog.wait()  # it ends once the children are gone
  if failed is None:
    print(f"launch_local: all {num_processes} processes finished", flush=True)
    return 0
  code = failed.popen.returncode
  if all(p.popen.returncode == _PREEMPTED for p in processes):
    print(f"launch_local: SIGTERM: all {num_processes} processes saved a checkpoint and stopped "
          f"(exit status {_PREEMPTED}); rerun the same command to resume", file=sys.stderr,
          flush=True)
    return _PREEMPTED
  silent = sorted(set().union(*(p.silent_peers for p in processes)))
  failure = (f"process {failed.index} (pid {failed.popen.pid}) failed: {describe(code)}; the "
             f"others were stopped")
  if silent:  # the cause first: the process that went silent, not the one the runtime stopped
    names = ", ".join(f"process {index}" for index in silent)
    report = [f"launch_local: {names} stopped answering: no heartbeat within "
              f"distributed.timeout_seconds, so the runtime stopped the others ({failure})"]
  else:
    report = [f"launch_local: {failure}"]
  for p in processes:
    state = (
      describe(p.popen.returncode) if p is failed else f"ended with {describe(p.popen.returncode)}"
    )
    report.append(f"--- process {p.index}, {state}; its last {len(p.lines)} lines:")
    report.extend(f"[{p.index}] {line}" for line in p.lines)
  if silent:
    report.append(report[0])  # and again last, after the tails
  print("\n".join(report), file=sys.stderr, flush=True)
  return code if code > 0 else 128 - code


def main(argv):
  if _NUM_PROCESSES.value < 1 or _DEVICES.value < 1:
    raise app.UsageError("--num_processes and --devices_per_process must be >= 1")
  if len(argv) < 2:
    raise app.UsageError("give train.py's flags after --, e.g. -- --config=... --workdir=...")
  # A launcher stopped by SIGTERM stops its processes too (the `finally` in launch).
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  if _GPUS.value is not None:
    split_gpus(_GPUS.value, _NUM_PROCESSES.value)  # refused now, before any process starts
  sys.exit(launch(_NUM_PROCESSES.value, _DEVICES.value, argv[1:], _TAIL.value, script=_SCRIPT.value,
                  gpus=_GPUS.value))


if __name__ == "__main__":
  cli.run(main)
