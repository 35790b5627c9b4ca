"""Our DiLoCo laid out as torchft runs it: K processes, one replica and one core each.

step_speed.py's `diloco K=2` runs both replicas as two devices of one process (its thread pool and
caches shared between them); torchft runs a process per replica. This peer of step_speed.py runs
the Trainer's DiLoCo the second way, through `jax.distributed` on 127.0.0.1 (as
experiments/launch_local.py does): K processes, each with one CPU device and pinned to its own
core (so XLA's thread pool has one thread, as each torchft replica has one torch thread), the mesh's
`replica` axis across the processes, the outer all-reduce through gloo.

  python benchmarks/peers/ours_diloco_processes.py --config_json='{...}' --replicas=2 \
      --sync_every=10

The driver (this script without --process_id) starts the K processes and speaks step_speed's peer
protocol (one JSON object per line): {"ready": ...} after one warm-up window of H inner steps, then
per `run N` command (N a multiple of H) the sum over the K processes of their CPU-seconds in those
N steps and the slowest one's wall time; `quit` stops them. The driver itself only waits.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT / "experiments"))


def _args(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--config_json", required=True, help="the Trainer's config (ConfigDict.to_json())")
  p.add_argument("--replicas", type=int, default=2, help="K: processes, one replica each")
  p.add_argument("--sync_every", type=int, default=10, help="H: inner steps per outer step")
  p.add_argument("--process_id", type=int, default=-1, help="internal: run as this process")
  p.add_argument("--coordinator_address", default="", help="internal: process 0's host:port")
  return p.parse_args(argv)


def _say(obj):
  print(json.dumps(obj), flush=True)


def process_main(a):
  cores = sorted(os.sched_getaffinity(0))
  os.sched_setaffinity(0, {cores[a.process_id % len(cores)]})  # before JAX sizes its thread pool
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lowcomm_jax import distributed  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import Trainer  # pylint: disable=g-import-not-at-top

  distributed.initialize("on", a.coordinator_address, a.replicas, a.process_id,
                         timeout_seconds=60, init_timeout_seconds=300)
  c = ml_collections.ConfigDict(json.loads(a.config_json))
  trainer = Trainer(c, pathlib.Path(tempfile.mkdtemp()) / "w")
  shape = (a.replicas, c.data.batch_size, c.data.seq_len + 1)
  tokens = np.random.default_rng(0).integers(0, 256, shape, dtype=np.int32)
  batch = jax.make_array_from_callback(shape, trainer.batch_sharding(), lambda index: tokens[index])
  state, step = trainer.init_state(), 0

  def run(steps):
    nonlocal state, step
    for _ in range(steps):
      step += 1
      program, _ = trainer.program(trainer.algorithm.phase_at(step), state)
      state = program(state, batch)[0]
    jax.block_until_ready(state)

  run(a.sync_every)  # one whole window: compiles the inner and the sync program
  _say({"ready": {"jax": jax.__version__, "devices": len(jax.devices())}})
  for line in sys.stdin:
    if line.startswith("run"):
      cpu, wall = time.process_time(), time.perf_counter()
      run(int(line.split()[1]))
      _say({"cpu_seconds": time.process_time() - cpu, "wall_seconds": time.perf_counter() - wall})
    elif line.startswith("quit"):
      break


def driver_main(a):
  import launch_local  # pylint: disable=g-import-not-at-top  (experiments/: free_port, child_env)
  address = f"127.0.0.1:{launch_local.free_port()}"
  # The processes' logs go to files: a pipe nobody reads would fill and stop them.
  logs = [pathlib.Path(tempfile.mkdtemp()) / f"process{i}.log" for i in range(a.replicas)]
  procs = [subprocess.Popen(
      [sys.executable, __file__, f"--config_json={a.config_json}", f"--replicas={a.replicas}",
       f"--sync_every={a.sync_every}", f"--process_id={i}", f"--coordinator_address={address}"],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, bufsize=1,
      env=launch_local.child_env(1)) for i, log in enumerate(logs)]

  def answers():
    out = []
    for p, log in zip(procs, logs):
      while True:
        line = p.stdout.readline()
        if not line:
          raise SystemExit(f"a process exited with code {p.wait()}: {log.read_text()[-3000:]}")
        if line.startswith("{"):
          out.append(json.loads(line))
          break
    return out

  ready = answers()[0]["ready"]
  _say({"ready": {**ready, "processes": a.replicas}})
  for line in sys.stdin:
    for p in procs:
      p.stdin.write(line)
      p.stdin.flush()
    if line.startswith("quit"):
      break
    if line.startswith("run"):
      results = answers()
      _say({"cpu_seconds": sum(r["cpu_seconds"] for r in results),
            "wall_seconds": max(r["wall_seconds"] for r in results)})
  for p in procs:
    p.wait(timeout=120)


if __name__ == "__main__":
  args = _args()
  (process_main if args.process_id >= 0 else driver_main)(args)
