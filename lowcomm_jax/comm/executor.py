"""The outer-communication executor: one thread issues every cross-process collective of the outer loop.

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

  executor = OuterCommExecutor(codec=None)             # or a codec, kernels, error feedback
  future = executor.submit(step, p, delta_R)           # when fragment p is due: Δ_p of every replica
  ...                                                  # τ inner steps, no collective in them
  mean_R = future.result()                             # at the merge (step + τ): waits on this only
  executor.close()

`delta_R` is a pytree of arrays whose leading axis is the replica axis (M), laid out like the
Trainer's per-replica state: stacked on one device (replicas simulated with vmap) or sharded over
the mesh axis `replica` (one slot per process or per device group). Each fragment gets its own
jitted program, `jax.vmap(mean, axis_name="replica")` over that leading axis, compiled once per
input layout: `fragment_mean`, the same computation as the inline mean inside the step's program,
and its result is bit-identical to it (`tests/test_comm_executor.py`, on two processes). A step
program that holds the mean and the outer update together may round the update differently from
one that receives the mean as an input: Streaming DiLoCo with τ = 1 and the float32 mean ends within
6.0e-8 of the inline run (18 steps, M = 4); with τ = 2 or a codec it is bit-identical.

Order: the thread runs submissions one at a time in the order they were submitted, and refuses a
submission that goes back in (step, fragment) order. Every process submits in schedule order, so
every process issues the same collectives in the same order and none can deadlock on another.
Cross-process collectives issued by the training thread (metric gathers, barriers, checkpoints)
are a second ordered stream beside this one; whether gloo keeps two streams between the same
processes apart has not been checked here, so call `drain()` before them.

Ledger: each fragment's program records its collectives once, when it is traced (in the
executor's thread); `entries(p)` gives them and `sent_bytes` adds them up for every submission.
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
from lowcomm_jax.comm import collectives
from lowcomm_jax.comm.compressed_mean import compressed_mean
from lowcomm_jax.comm import ledger as ledger_lib

__all__ = ["OuterCommExecutor", "Issued", "check_layout", "fragment_mean"]


@dataclasses.dataclass(frozen=True)
class Issued:
  """One collective as the executor ran it (times from `time.perf_counter`, on this process).

  Attributes:
    step: the inner step the submission was made for.
    fragment: the fragment p.
    submitted_s: when `submit` was called.
    started_s: when the thread dispatched the program.
    finished_s: when its result was ready.
  """

  step: int
  fragment: int
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
          f"diloco.overlap_executor=thread needs every replica slot inside one process, but slot "
          f"{r} of the mesh's `replica` axis spans processes {owners}: keep mesh.data, mesh.tensor "
          f"and mesh.stage within a process (mesh.replica a multiple of the process count), or "
          "use diloco.overlap_executor=inline")


class OuterCommExecutor:
  """A dedicated thread that alone issues the outer loop's cross-replica collectives.

  Args:
    codec: None for a float32 mean (`comm.mean`, an all-reduce), or a `lowcomm_jax.codecs` Codec
      for the compressed mean (`comm.compressed_mean`: all_to_all + all_gather of encoded chunks).
    kernels: the codec's encode/decode ("reference", "pallas", "auto"; see
      `lowcomm_jax.codecs.kernel_options`).
    axis_name: the replica axis the programs bind (`vmap` over the leading axis).
    mesh: when given, checked with `check_layout` (inner axes inside one process).
  """

  def __init__(self, codec=None, kernels: str = "auto", axis_name: str = mesh_lib.REPLICA,
               mesh=None):
    if mesh is not None:
      check_layout(mesh)
    codecs.kernel_options(kernels, codec)  # a mode that cannot run is refused before the thread starts
    self.codec, self.kernels, self.axis_name, self.mesh = codec, kernels, axis_name, mesh
    self.issued: list[Issued] = []  # in the order the thread ran them
    self._programs: dict[tuple, Any] = {}  # (fragment, input layout) -> compiled program
    self._entries: dict[int, list[ledger_lib.Entry]] = {}
    self._sent_bytes = 0.0
    self._last: tuple[int, int] | None = None
    self._lock = threading.Lock()
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._closed = False
    self._thread = threading.Thread(target=self._serve, name="lowcomm-outer-comm", daemon=True)
    self._thread.start()

  # ----------------------------------------------------------------------------- the loop's API
  def submit(self, step: int, fragment: int, delta_tree, residual=None, key=None
             ) -> concurrent.futures.Future:
    """Queues fragment `fragment`'s mean over replicas; returns a future of it.

    Args:
      step: the inner step the outer gradient belongs to (schedule order: nondecreasing).
      fragment: p; within one step, fragments go in increasing order.
      delta_tree: Δ_p, a pytree of arrays with a leading replica axis M.
      residual: with a codec, the error-feedback residuals (same structure, leading M), or None.
      key: with stochastic rounding, the PRNG key (the same on every replica).

    Returns:
      A `concurrent.futures.Future` whose `result()` is the mean (every replica's copy, leading
      M, float32), or `(mean, new residual)` when `residual` is given.

    Raises:
      ValueError: a submission that goes back in (step, fragment) order, or a residual without a
        codec; RuntimeError after `close()`.
    """
    if residual is not None and self.codec is None:
      raise ValueError("residual: error feedback needs a codec (diloco.codec), got codec=None")
    with self._lock:
      if self._closed:
        raise RuntimeError("OuterCommExecutor.submit after close()")
      if self._last is not None and (step, fragment) <= self._last:
        raise ValueError(
            f"submit(step={step}, fragment={fragment}) after (step={self._last[0]}, fragment="
            f"{self._last[1]}): submissions must follow the schedule order on every process, or "
            "processes issue their collectives in different orders and deadlock")
      self._last = (step, fragment)
      future: concurrent.futures.Future = concurrent.futures.Future()
      self._queue.put((step, fragment, delta_tree, residual, key, future, time.perf_counter()))
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

  def entries(self, fragment: int) -> list[ledger_lib.Entry]:
    """The ledger entries of fragment `fragment`'s program (after its first submission ran)."""
    return list(self._entries.get(fragment, []))

  @property
  def sent_bytes(self) -> float:
    """Bytes each worker sent through the executor so far (the ledger's, per submission)."""
    return self._sent_bytes

  # ------------------------------------------------------------------------------ the thread
  def _program(self, fragment: int, args: tuple):
    layout = tuple((x.shape, x.dtype, getattr(x, "sharding", None))
                   for x in jax.tree.leaves(args))
    cache_key = (fragment, jax.tree.structure(args), layout)
    if cache_key not in self._programs:
      ledger = ledger_lib.Ledger()
      tracing = contextlib.nullcontext() if self.mesh is None else mesh_lib.tracing(self.mesh)
      with ledger.recording(), tracing:
        lowered = jax.jit(fragment_mean(fragment, self.codec, self.kernels, self.axis_name)).lower(
            *args)
      self._programs[cache_key] = lowered.compile()
      self._entries[fragment] = ledger.entries
    return self._programs[cache_key]

  def _serve(self) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        return
      if isinstance(item, concurrent.futures.Future):  # drain(): everything before it finished
        item.set_result(None)
        continue
      step, fragment, delta, residual, key, future, submitted = item
      if not future.set_running_or_notify_cancel():
        continue
      try:
        program = self._program(fragment, (delta, residual, key))
        started = time.perf_counter()
        result = program(delta, residual, key)
        result = jax.block_until_ready(result)
        finished = time.perf_counter()
      except Exception as error:  # pylint: disable=broad-except
        future.set_exception(error)
        continue
      self._sent_bytes += sum(e.sent_bytes for e in self._entries[fragment])
      self.issued.append(Issued(step, fragment, submitted, started, finished))
      future.set_result(result)


def fragment_mean(fragment: int, codec=None, kernels: str = "auto",
                  axis_name: str = mesh_lib.REPLICA):
  """The body of fragment p's program: `(delta_R, residual_R, key) -> mean_R` (or with a residual
  `(mean_R, new residual_R)`), vmapped over the leading replica axis.

  The executor compiles it on its thread; called inside a step's program on the training thread
  it is the inline mean the executor must equal. Traced under a mesh holding `axis_name`
  (`mesh.tracing`), the leading axis is laid out over it (`spmd_axis_name`), so that a codec's
  compiled kernels, which run under a `shard_map` over every mesh axis, take each replica's
  slice where it lives instead of gathering Δ.
  """
  name = f"fragment {fragment}"

  def per_replica(delta, residual, key):
    if codec is None:
      return collectives.mean(delta, axis_name, name=name)
    return compressed_mean(delta, axis_name, codec, name, key=key,
                           residual=residual, kernels=kernels)

  def over_replicas(delta, residual=None, key=None):
    # Δ and the residual are per replica; the key is the same on every replica.
    in_axes = (0, None if residual is None else 0, None)
    spmd = axis_name if axis_name in jax.sharding.get_abstract_mesh().axis_names else None
    return jax.vmap(per_replica, in_axes=in_axes, axis_name=axis_name,
                    spmd_axis_name=spmd)(delta, residual, key)

  return over_replicas
