"""The outer-communication executor: one thread issues every cross-process collective of the outer
loop.

Why a thread: on XLA:CPU (and with NCCL on one stream) a collective dispatched from the training
thread holds back the compute dispatched after it until every peer has joined. Measured with two
processes and gloo, one peer joining an all-reduce 1.0 s late, a compute of 0.37 s alone:
dispatched from the training thread (before the compute, or with it in one jitted program) the
compute finished with the all-reduce, at 1.45–1.50 s; dispatched from this executor's thread, the
compute finished at 0.40 s and the all-reduce at 1.20 s (`benchmarks/comm_overlap.py`, medians of
5 rounds, docs/overlap.md). So Streaming DiLoCo's overlap of a
fragment's all-reduce with τ inner steps is real only when the collective leaves the training
thread.

How it is used (the train loop's side of Streaming DiLoCo with τ ≥ 1):

  executor = OuterCommExecutor()
  # when plan `name` is due: every replica's tree
  future = executor.submit(step, name, delta_R, plan=plan)
  ...                                                  # τ inner steps, no collective in them
  mean_R = future.result()                             # at the merge (step + τ): waits on this only
  executor.close()

`delta_R` is a pytree of arrays whose leading axis is the replica axis (M), laid out like the
Trainer's per-replica state: stacked on one device (replicas simulated with vmap) or sharded over
the mesh axis `replica` (one slot per process or per device group). Each plan gets its own
jitted program, `comm.dispatch.over_replicas`: `comm.carry` vmapped over that leading axis,
compiled once per input layout, the same computation as the inline carry inside the step's
program, and its result is bit-identical to it (`tests/test_comm_executor.py`, on two processes). A
step program that holds the mean and the outer update together may round the update differently from
one that receives the mean as an input: Streaming DiLoCo with τ = 1 and the float32 mean ends within
6.0e-8 of the inline run (18 steps, M = 4); with τ = 2 or a codec it is bit-identical.

Order: the thread runs submissions one at a time in the order they were submitted, and refuses a
submission for an earlier step than the last, or a name submitted twice in one step. Every process
submits in schedule order, so every process issues the same collectives in the same order and none
can deadlock on another. Cross-process collectives issued by the training thread (metric gathers,
barriers, checkpoints) are a second ordered stream beside this one; whether gloo keeps two streams
between the same processes apart has not been checked here, so call `drain()` before them.

Ledger: each plan's program records its collectives once, when it is traced (in the
executor's thread); `entries(name)` gives them and `sent_bytes` adds them up for every submission.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
import time
from typing import Any

import jax

from lowcomm_jax import codecs, mesh as mesh_lib
from lowcomm_jax.comm import dispatch, ledger as ledger_lib
from lowcomm_jax.comm.plan import Plan

__all__ = ["OuterCommExecutor", "Issued", "check_layout", "fragment_mean"]


@dataclasses.dataclass(frozen=True)
class Issued:
  """One collective as the executor ran it (times from `time.perf_counter`, on this process).

  Attributes:
    step: the inner step the submission was made for.
    name: the plan's name (Streaming DiLoCo: "fragment p").
    submitted_s: when `submit` was called.
    started_s: when the thread dispatched the program.
    finished_s: when its result was ready.
  """

  step: int
  name: str
  submitted_s: float
  started_s: float
  finished_s: float


def check_layout(mesh) -> None:
  """Refuses a mesh whose inner axes (data, tensor, stage) cross a process boundary.

  With the executor on, the only cross-process traffic is the executor's mean over `replica`; a
  replica slot spanning two processes would put collectives in every step's program too, issued
  by the training thread, and the two threads could then deadlock each other across processes.

  Raises:
    ValueError: naming the replica slot and the processes it spans.
  """
  devices = mesh.devices
  axis = mesh.axis_names.index(mesh_lib.REPLICA) if mesh_lib.REPLICA in mesh.axis_names else None
  slots = [devices] if axis is None else [devices.take(r, axis) for r in range(devices.shape[axis])]
  for r, slot in enumerate(slots):
    owners = sorted({d.process_index for d in slot.flat})
    if len(owners) > 1:
      raise ValueError(
          f"outer.overlap_executor=thread needs every replica slot inside one process, but slot "
          f"{r} of the mesh's `replica` axis spans processes {owners}: keep mesh.data, mesh.tensor "
          f"and mesh.stage within a process (mesh.replica a multiple of the process count), or "
          "use outer.overlap_executor=inline")


class OuterCommExecutor:
  """A dedicated thread that alone issues the outer loop's cross-replica collectives.

  Args:
    codec: the plan of a submission that names none: None for a float32 mean (`comm.mean`, an
      all-reduce), or a `lowcomm_jax.codecs` Codec for the compressed mean
      (`comm.compressed_mean`: all_to_all + all_gather of encoded chunks).
    kernels: that codec's encode/decode (one of `codecs.KERNEL_MODES`; see
      `lowcomm_jax.codecs.kernel_options`).
    axis_name: the replica axis the programs bind (`vmap` over the leading axis).
    mesh: when given, checked with `check_layout` (inner axes inside one process).
  """

  def __init__(self, codec=None, kernels: str = "auto", axis_name: str = mesh_lib.REPLICA,
               mesh=None):
    if mesh is not None:
      check_layout(mesh)
    # a mode that cannot run is refused before the thread starts
    codecs.kernel_options(kernels, codec)
    self.codec, self.kernels, self.axis_name, self.mesh = codec, kernels, axis_name, mesh
    self.issued: list[Issued] = []  # in the order the thread ran them
    self._programs: dict[tuple, Any] = {}  # (name, input layout) -> compiled program
    self._entries: dict[str, list[ledger_lib.Entry]] = {}
    self._sent_bytes = 0.0
    self._last: tuple[int, set] = (-1, set())  # the last step submitted and its names
    self._lock = threading.Lock()
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._closed = False
    self._thread = threading.Thread(target=self._serve, name="lowcomm-outer-comm", daemon=True)
    self._thread.start()

  # ----------------------------------------------------------------------------- the loop's API
  def submit(self, step: int, name: str, tree, residual=None, key=None, plan: Plan | None = None
             ) -> concurrent.futures.Future:
    """Queues `tree` carried as `plan` over replicas; returns a future of the result.

    Args:
      step: the inner step the tree belongs to (schedule order: nondecreasing).
      name: the plan's name; within one step, in the order the algorithm lists its plans.
      tree: a pytree of arrays with a leading replica axis M.
      residual: with error feedback, the residuals (same structure, leading M), or None.
      key: with stochastic rounding, the PRNG key (the same on every replica).
      plan: the `comm.Plan`; default the executor's codec's mean (error feedback when a residual
        is given).

    Returns:
      A `concurrent.futures.Future` whose `result()` is the carried tree (every replica's copy,
      leading M, float32), or `(result, new residual)` when `residual` is given.

    Raises:
      ValueError: a submission for an earlier step, a name twice in one step, or a residual without
        a codec; RuntimeError after `close()`.
    """
    if plan is None:
      if residual is not None and self.codec is None:
        raise ValueError("residual: error feedback needs a codec (outer.codec), got codec=None")
      plan = Plan("mean" if self.codec is None else "compressed_mean", self.codec,
                  error_feedback=residual is not None, kernels=self.kernels)
    with self._lock:
      if self._closed:
        raise RuntimeError("OuterCommExecutor.submit after close()")
      last_step, names = self._last
      if step < last_step or (step == last_step and name in names):
        raise ValueError(
            f"submit(step={step}, name={name!r}) after step {last_step} ({sorted(names)}): "
            "submissions must follow the schedule order on every process, or processes issue "
            "their collectives in different orders and deadlock")
      self._last = (step, names | {name} if step == last_step else {name})
      future: concurrent.futures.Future = concurrent.futures.Future()
      self._queue.put((step, name, plan, tree, residual, key, future, time.perf_counter()))
    return future

  def drain(self) -> None:
    """Waits until every submitted collective has finished (before other cross-process work)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    self._queue.put(done)
    done.result()

  def close(self) -> None:
    """Finishes the queued collectives and stops the thread; idempotent."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      self._queue.put(None)
    self._thread.join()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def entries(self, name: str) -> list[ledger_lib.Entry]:
    """The ledger entries of plan `name`'s program (after its first submission ran)."""
    return list(self._entries.get(name, []))

  @property
  def sent_bytes(self) -> float:
    """Bytes each worker sent through the executor so far (the ledger's, per submission)."""
    return self._sent_bytes

  # ------------------------------------------------------------------------------ the thread
  def _program(self, name: str, plan: Plan, args: tuple):
    layout = tuple((x.shape, x.dtype, getattr(x, "sharding", None))
                   for x in jax.tree.leaves(args))
    cache_key = (name, id(plan), jax.tree.structure(args), layout)
    if cache_key not in self._programs:
      ledger = ledger_lib.Ledger()
      tracing = contextlib.nullcontext() if self.mesh is None else mesh_lib.tracing(self.mesh)
      with ledger.recording(), tracing:
        lowered = jax.jit(dispatch.over_replicas(plan, name, self.axis_name)).lower(*args)
      self._programs[cache_key] = (lowered.compile(), plan)  # the plan kept: its id stays unique
      self._entries[name] = ledger.entries
    return self._programs[cache_key][0]

  def _serve(self) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        return
      if isinstance(item, concurrent.futures.Future):  # drain(): everything before it finished
        item.set_result(None)
        continue
      step, name, plan, delta, residual, key, future, submitted = item
      if not future.set_running_or_notify_cancel():
        continue
      try:
        program = self._program(name, plan, (delta, residual, key))
        started = time.perf_counter()
        result = program(delta, residual, key)
        result = jax.block_until_ready(result)
        finished = time.perf_counter()
      except Exception as error:  # pylint: disable=broad-except
        future.set_exception(error)
        continue
      self._sent_bytes += sum(e.sent_bytes for e in self._entries[name])
      self.issued.append(Issued(step, name, submitted, started, finished))
      future.set_result(result)


def fragment_mean(fragment: int, codec=None, kernels: str = "auto",
                  axis_name: str = mesh_lib.REPLICA):
  """Streaming DiLoCo's fragment p program as the thread runs it: `(delta_R, residual_R, key) ->
  mean_R` (or with a residual `(mean_R, new residual_R)`), `comm.dispatch.over_replicas` of the
  plan "fragment p" (the float32 mean, or `codec`'s compressed mean; error feedback when a residual
  is passed)."""
  name = f"fragment {fragment}"
  kind = "mean" if codec is None else "compressed_mean"

  def run(delta, residual=None, key=None):
    plan = Plan(kind, codec, error_feedback=residual is not None, kernels=kernels)
    return dispatch.over_replicas(plan, name, axis_name)(delta, residual, key)

  return run
