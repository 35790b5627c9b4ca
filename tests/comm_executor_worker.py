"""One process of tests/test_comm_executor.py (run as a script, never imported by a test).

  python tests/comm_executor_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID OUT_JSON

Each process has one CPU device holding one replica; the mesh's `replica` axis spans the
processes. It checks, against the other process:
  equal: the executor's mean of every case equals the inline mean (the same fragment program called
    on the training thread, alone and inside a step-like program with compute) bit for bit;
  order: the executor ran the submissions in submission order, and refuses one that goes back;
  late peer: process 1 submits only once process 0's compute has finished (a file process 0 writes
    then); process 0's compute, dispatched on the main thread while its all-reduce waits for the
    peer, must finish without it (an all-reduce that blocked it would leave process 1 waiting).
and writes what it saw to OUT_JSON.
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lowcomm_jax import codecs, comm, distributed, mesh as mesh_lib

PEER_WAIT_S = 300  # process 1's bound on waiting for process 0's compute


def local(tree):
  """This process's rows of replica-sharded arrays, as numpy."""
  return jax.tree.map(lambda x: np.concatenate([np.asarray(s.data) for s in x.addressable_shards]),
                      tree)


def same(a, b) -> bool:
  return all(np.array_equal(x, y, equal_nan=True)
             for x, y in zip(jax.tree.leaves(local(a)), jax.tree.leaves(local(b)), strict=True))


def main(coordinator, num_processes, process_id, out_path):
  distributed.initialize("on", coordinator, num_processes, process_id, timeout_seconds=30,
                         init_timeout_seconds=120)
  mesh = mesh_lib.make_mesh({mesh_lib.REPLICA: num_processes}, jax.devices())
  rows = NamedSharding(mesh, P(mesh_lib.REPLICA))
  me = jax.process_index()
  try:
    comm.check_layout(mesh_lib.make_mesh({mesh_lib.REPLICA: 1, mesh_lib.DATA: num_processes}))
    refused = False
  except ValueError as error:
    refused = "outer.overlap_executor=thread" in str(error)
  rng = np.random.default_rng(100 + me)  # every replica its own outer gradient

  def replicated_rows(*shape):
    value = rng.standard_normal((1,) + shape).astype(np.float32) * np.float32(1 + me)
    return distributed.global_array(value, rows, (num_processes,) + shape)

  delta = {"w": replicated_rows(40, 33), "b": replicated_rows(7)}
  residual = jax.tree.map(lambda x: 0.01 * x,
                          {"w": replicated_rows(40, 33), "b": replicated_rows(7)})
  key = jax.random.key(7)
  e3m0 = codecs.get_codec("e3m0", block_size=64)
  stochastic = codecs.get_codec("int4", block_size=32, rounding="stochastic")
  cases = {  # name: (codec, args of submit after delta)
      "float32 all-reduce": (None, ()),
      "e3m0 compressed mean with error feedback": (e3m0, (residual,)),
      "int4 stochastic rounding": (stochastic, (None, key)),
  }
  x = jnp.ones((256, 256), jnp.float32)
  compute = jax.jit(lambda x: jnp.tanh(x @ x / 256.0) @ x)
  report = {"equal": {}, "equal_inside_step": {}, "inner_axes_across_processes_refused": refused}

  executors = {name: comm.OuterCommExecutor(codec, mesh=mesh) for name, (codec, _) in cases.items()}
  step = 0
  for name, (codec, args) in cases.items():
    step += 1
    future = executors[name].submit(step, "fragment 0", delta, *args)
    got = future.result()
    inline = jax.jit(comm.fragment_mean(0, codec))(delta, *args)
    in_step = jax.jit(lambda d, x, *a, c=codec: (comm.fragment_mean(0, c)(d, *a), compute(x)))(
        delta, x, *args)[0]
    report["equal"][name] = same(got, inline)
    report["equal_inside_step"][name] = same(got, in_step)
    # Not vacuous: the mean differs from this replica's own values.
    mean = got[0] if isinstance(got, tuple) else got
    report.setdefault("mean_differs_from_own", {})[name] = not same(mean, delta)

  # Order: four submissions of two fragments in schedule order, on one executor.
  ex = executors["float32 all-reduce"]
  futures = [ex.submit(s, f"fragment {p}", delta) for s, p in [(10, 0), (10, 1), (12, 0), (14, 1)]]
  for f in futures:
    f.result()
  report["issued_order"] = [[i.step, int(i.name.split()[-1])] for i in ex.issued]
  try:
    ex.submit(13, "fragment 0", delta)
    report["out_of_order_refused"] = False
  except ValueError as error:
    report["out_of_order_refused"] = "schedule order" in str(error)
  report["entries"] = [[e.kind, e.payload_bytes, e.num_workers] for e in ex.entries("fragment 0")]

  # Late peer: the program is compiled (above); process 1 joins once process 0's compute is done.
  jax.block_until_ready(compute(x))
  distributed.barrier("late peer")
  computed = os.path.join(os.path.dirname(out_path), "process0_computed")
  if me == 1:
    deadline = time.monotonic() + PEER_WAIT_S
    while not os.path.exists(computed):
      assert time.monotonic() < deadline, "process 0's compute never finished while it communicated"
      time.sleep(0.05)
  start = time.perf_counter()
  future = ex.submit(20, "fragment 0", delta)
  time.sleep(0.2)  # the executor thread has (most likely) dispatched the all-reduce by now
  jax.block_until_ready(compute(x))
  compute_done = time.perf_counter() - start
  comm_done_before_compute = future.done()
  if me == 0:
    open(computed, "w").close()
  future.result()
  report["late_peer"] = {"compute_done_s": compute_done,
                         "comm_done_before_compute": comm_done_before_compute,
                         "comm_done_s": ex.issued[-1].finished_s - start}
  for executor in executors.values():
    executor.close()
  with open(out_path, "w") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
