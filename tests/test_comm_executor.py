"""The outer-communication executor (lowcomm_jax.comm.executor): the same means as inline, in
schedule order, and compute on the training thread not held back by a late peer's all-reduce.

The two-process checks run tests/comm_executor_worker.py twice, joined by jax.distributed on
127.0.0.1 (gloo), one CPU device and one replica each. How long the overlap saves is measured by
benchmarks/comm_overlap.py, not here: the test asserts only which finished first, with the peer
1.0 s late.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax import codecs, comm

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "comm_executor_worker.py"


def _launch_local():
  spec = importlib.util.spec_from_file_location("launch_local", ROOT / "experiments" / "launch_local.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_two_processes_equal_inline_in_order_and_compute_not_blocked_by_a_late_peer(tmp_path):
  launch_local = _launch_local()
  coordinator = f"127.0.0.1:{launch_local.free_port()}"
  env = dict(launch_local.child_env(1), PYTHONPATH=str(ROOT))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # written by process 0 only; not needed here
  outputs = [tmp_path / f"process{i}.json" for i in range(2)]
  procs = [subprocess.Popen([sys.executable, str(WORKER), coordinator, "2", str(i), str(outputs[i])],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  logs = [p.communicate(timeout=300)[0] for p in procs]
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  reports = [json.loads(o.read_text()) for o in outputs]
  for report in reports:
    # (a) bit-identical to the inline mean, alone and inside a program with compute.
    assert report["equal"] == {name: True for name in report["equal"]} and len(report["equal"]) == 3
    assert all(report["equal_inside_step"].values())
    assert all(report["mean_differs_from_own"].values())
    # Ordering: run in submission (schedule) order; going back is refused.
    assert report["issued_order"][-4:] == [[10, 0], [10, 1], [12, 0], [14, 1]]
    assert report["out_of_order_refused"]
    assert report["entries"] == [["all_reduce", (40 * 33 + 7) * 4, 2]]
    # A layout whose `data` axis spans the two processes is refused, naming the option.
    assert report["inner_axes_across_processes_refused"]
  # (b) the process whose peer joined late: its compute finished while the all-reduce waited.
  late = reports[0]["late_peer"]
  assert not late["comm_done_before_compute"], late
  assert late["compute_done_s"] < late["comm_done_s"], late


def test_one_process_vmap_equals_inline_and_ledger_counts_each_submission():
  delta = {"w": jax.random.normal(jax.random.key(0), (4, 50, 3)), "b": jnp.arange(4.0 * 9).reshape(4, 9)}
  residual = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), delta)
  codec = codecs.get_codec("e2m1", block_size=16)
  with comm.OuterCommExecutor() as plain, comm.OuterCommExecutor(codec) as coded:
    futures = [plain.submit(4, 0, delta), plain.submit(4, 1, delta), coded.submit(8, 1, delta, residual)]
    means = [f.result() for f in futures]
    for got, want in zip(means, [jax.jit(comm.fragment_mean(0))(delta),
                                 jax.jit(comm.fragment_mean(1))(delta),
                                 jax.jit(comm.fragment_mean(1, codec))(delta, residual)]):
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The mean is every replica's: rows equal, and the float32 one is the arithmetic mean.
    np.testing.assert_allclose(np.asarray(means[0]["b"][2]), np.asarray(delta["b"]).mean(0), rtol=1e-6)
    payload = (50 * 3 + 9) * 4
    assert plain.entries(1) == [comm.Entry("fragment 1", "all_reduce", payload,
                                           comm.ring_factor(4) * payload, 4)]
    assert plain.sent_bytes == 2 * comm.ring_factor(4) * payload
    assert coded.sent_bytes == comm.compressed_mean_wire_bytes(
        jax.tree.map(lambda x: x[0], delta), codec, 4)
    assert [(i.step, i.fragment) for i in plain.issued] == [(4, 0), (4, 1)]
    with pytest.raises(ValueError, match=r"schedule order"):
      plain.submit(4, 0, delta)
    with pytest.raises(ValueError, match=r"error feedback needs a codec"):
      plain.submit(5, 0, delta, residual)
  with pytest.raises(RuntimeError, match="after close"):
    plain.submit(9, 0, delta)


def test_a_failing_program_fails_its_future_only():
  with comm.OuterCommExecutor() as executor:
    bad = executor.submit(1, 0, {"w": jnp.ones((2, 3)), "b": jnp.ones((3, 3))})  # replica axes differ
    with pytest.raises(ValueError):
      bad.result()
    good = executor.submit(2, 0, jnp.ones((2, 3)))
    np.testing.assert_array_equal(np.asarray(good.result()), np.ones((2, 3)))
