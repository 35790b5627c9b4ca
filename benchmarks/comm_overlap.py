"""Does compute wait for a late peer's all-reduce? Same thread vs the outer-communication executor.

  python benchmarks/comm_overlap.py [--late_s=1.0 --repeats=5 --values=1000000]

Two processes on this machine (jax.distributed on 127.0.0.1, gloo), one CPU device and one replica
each. In every round both processes start an all-reduce of a fragment (`--values` float32) and
then a compute of a few matmuls; process 1 joins the all-reduce `--late_s` late. Process 0 times,
from the round's start, when its compute finished and when its all-reduce finished, with the
all-reduce dispatched
  serial:      from the training thread, then the compute (both dispatched asynchronously);
  one program: from the training thread, in one jitted program with the compute (as the inline
               Streaming DiLoCo step holds its fragment's all-reduce);
  executor:    by `comm.OuterCommExecutor`'s thread, the compute from the training thread.
Prints a table and writes benchmarks/results/comm_overlap.json: per mode the median over rounds
of each time, and the compute's finish time relative to the executor's.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]

_LATE = flags.DEFINE_float("late_s", 1.0, "How late process 1 joins each all-reduce (seconds).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Rounds per mode (medians are reported).")
_VALUES = flags.DEFINE_integer("values", 1_000_000, "float32 values in the all-reduced fragment.")
_ROLE = flags.DEFINE_string("role", "launcher", "launcher | worker (internal).")
_COORDINATOR = flags.DEFINE_string("coordinator", "", "Internal: the coordinator address.")
_PROCESS = flags.DEFINE_integer("process_id", 0, "Internal: this worker's process id.")
_OUT = flags.DEFINE_string("out", str(ROOT / "benchmarks" / "results" / "comm_overlap.json"),
                           "Where to write the results.")

MODES = ("serial", "one program", "executor")


def worker() -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  from lowcomm_jax import comm, distributed, mesh as mesh_lib  # pylint: disable=g-import-not-at-top

  distributed.initialize("on", _COORDINATOR.value, 2, _PROCESS.value, timeout_seconds=60)
  mesh = mesh_lib.make_mesh({mesh_lib.REPLICA: 2}, jax.devices())
  value = np.full((1, _VALUES.value), 1.0 + jax.process_index(), np.float32)
  delta = distributed.global_array(value, NamedSharding(mesh, P(mesh_lib.REPLICA)),
                                   (2, _VALUES.value))
  x = jnp.ones((512, 512), jnp.float32) / 512

  def matmuls(x):
    for _ in range(6):
      x = jnp.tanh(x @ x)
    return x

  compute = jax.jit(matmuls)
  mean = jax.jit(comm.fragment_mean(0))
  together = jax.jit(lambda d, x: (comm.fragment_mean(0)(d), matmuls(x)))
  executor = comm.OuterCommExecutor(mesh=mesh)
  # Compile everything once, peers on time.
  jax.block_until_ready((compute(x), mean(delta), together(delta, x)))
  executor.submit(0, 0, delta).result()

  step = 0
  times = {mode: {"compute_s": [], "all_reduce_s": []} for mode in MODES}
  alone = []
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    jax.block_until_ready(compute(x))
    alone.append(time.perf_counter() - start)
    for mode in MODES:
      distributed.barrier(f"round {step}")
      if jax.process_index() == 1:
        time.sleep(_LATE.value)
      start = time.perf_counter()
      if mode == "serial":
        reduced = mean(delta)
        out = compute(x)
        jax.block_until_ready(out)
        compute_s = time.perf_counter() - start
        jax.block_until_ready(reduced)
        reduce_s = time.perf_counter() - start
      elif mode == "one program":
        reduced, out = together(delta, x)
        jax.block_until_ready(out)
        compute_s = time.perf_counter() - start
        jax.block_until_ready(reduced)
        reduce_s = time.perf_counter() - start
      else:
        step += 1
        future = executor.submit(step, 0, delta)
        out = compute(x)
        jax.block_until_ready(out)
        compute_s = time.perf_counter() - start
        future.result()
        reduce_s = executor.issued[-1].finished_s - start
      times[mode]["compute_s"].append(compute_s)
      times[mode]["all_reduce_s"].append(reduce_s)
      step += 1
  executor.close()
  median = lambda v: float(np.median(v))
  return {"compute_alone_s": median(alone),
          "modes": {mode: {k: median(v) for k, v in t.items()} | {"rounds": t}
                    for mode, t in times.items()}}


def main(argv) -> None:
  del argv
  if _ROLE.value == "worker":
    report = worker()
    if _PROCESS.value == 0:
      print("REPORT " + json.dumps(report), flush=True)
    return
  sys.path.insert(0, str(ROOT / "experiments"))
  import launch_local  # pylint: disable=g-import-not-at-top
  coordinator = f"127.0.0.1:{launch_local.free_port()}"
  env = dict(launch_local.child_env(1), PYTHONPATH=str(ROOT))
  procs = [subprocess.Popen(
      [sys.executable, __file__, "--role=worker", f"--coordinator={coordinator}",
       f"--process_id={i}", f"--late_s={_LATE.value}", f"--repeats={_REPEATS.value}",
       f"--values={_VALUES.value}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True) for i in range(2)]
  outputs = [p.communicate(timeout=1800)[0] for p in procs]
  for p, out in zip(procs, outputs):
    if p.returncode:
      raise SystemExit(f"a worker failed (exit status {p.returncode}):\n{out[-3000:]}")
  report = json.loads(next(line for line in outputs[0].splitlines()
                           if line.startswith("REPORT "))[len("REPORT "):])
  executor_compute = report["modes"]["executor"]["compute_s"]
  rows = []
  print(f"peer {_LATE.value:.1f} s late, {_VALUES.value} float32 values, compute alone "
        f"{report['compute_alone_s']:.3f} s (medians of {_REPEATS.value} rounds, process 0)")
  print(f"{'all-reduce dispatched':<24} {'compute done':>13} {'all-reduce done':>16} "
        f"{'compute / executor':>19}")
  for mode in MODES:
    m = report["modes"][mode]
    ratio = m["compute_s"] / executor_compute
    rows.append({"mode": mode, "compute_s": m["compute_s"], "all_reduce_s": m["all_reduce_s"],
                 "compute_vs_executor": ratio})
    print(f"{mode:<24} {m['compute_s']:>12.3f}s {m['all_reduce_s']:>15.3f}s {ratio:>18.2f}x")
  result = {"command": "python benchmarks/comm_overlap.py " + " ".join(
      f"--{f}={v}" for f, v in (("late_s", _LATE.value), ("repeats", _REPEATS.value),
                                ("values", _VALUES.value))),
            "late_s": _LATE.value, "values": _VALUES.value, "repeats": _REPEATS.value,
            "compute_alone_s": report["compute_alone_s"], "rows": rows,
            "rounds": {mode: report["modes"][mode]["rounds"] for mode in MODES}}
  pathlib.Path(_OUT.value).write_text(json.dumps(result, indent=1) + "\n")
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
