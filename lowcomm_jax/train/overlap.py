"""Streaming DiLoCo's overlapped all-reduces on their own thread, as the Trainer's loop runs them.

`diloco.overlap_executor` picks how a fragment p with τ ≥ 1 travels (docs/overlap.md):

  inline  its mean sits in the send step's own program (`streaming.py`), issued by the training
          thread: on XLA:CPU the steps dispatched after it wait for every peer to join.
  thread  `comm.OuterCommExecutor`: on the send step the loop computes Δ_p = φ_p − θ_p from the
          parameters entering the step (a small program without collectives), submits it and
          runs the step without that send. The merge step's program runs without the merge (its
          forward, backward and inner update do not need the mean: they overlap the all-reduce
          too); after dispatching it, the loop waits on that future only, writes the mean into
          the fragment's in-flight buffer and runs the outer step and merge as a program of
          their own (`StreamingDiLoCo.merge_in_flight`, no collective).
  auto    (default) thread where it works: Streaming DiLoCo with τ ≥ 1 on the `replicas` or
          `skippipe` gradient sources; inline elsewhere (DiLoCo and τ = 0 have nothing to overlap,
          NoLoCo and data parallel have no outer all-reduce, the pipeline keeps a grid layout).

The loop sees `Overlap`: `before_step` (the phase the step's program runs), `after_step` (the
state once the merges left out of that program ran), `settle` (every future written into the
state: before a checkpoint and at the end, so a checkpoint holds the in-flight mean exactly as the
inline state does), `quiet` (no collective of the executor running: before the training thread's
own cross-process work, e.g. metric gathers) and `close`.

Same results as inline within 1e-7 (max abs over parameters and state; tests/test_overlap_loop.py):
the thread's merge program applies the outer step to the parameters the step's program wrote,
inline applies it inside the step, where XLA fuses it with the inner update and the step's
`θ + (merged − θ)`; the two round differently at the ulp scale.
"""

from __future__ import annotations

import jax
import numpy as np

from lowcomm_jax import comm, distributed
from lowcomm_jax.optim.schedule import Phase
from lowcomm_jax.optim.streaming import StreamingDiLoCo

OVERLAP_EXECUTORS = ("auto", "thread", "inline")
_THREAD_SOURCES = ("replicas", "skippipe")  # per-replica state with a leading [M] axis


class Inline:
  """Every collective in the step's own program: nothing to do around it."""

  executor = None

  def before_step(self, step: int, phase, state):
    return phase, state

  def after_step(self, state):
    return state

  def settle(self, state):
    return state

  def quiet(self) -> None:
    pass

  def close(self) -> None:
    pass


def choose(mode: str, algorithm, source, mesh) -> str:
  """"thread" or "inline": what `diloco.overlap_executor=mode` means for this algorithm, gradient
  source and mesh (checked in the Trainer's constructor, before any compute).

  Raises:
    ValueError: an unknown mode (naming the allowed ones); `thread` where it cannot work (naming
      why); `thread` on a mesh whose inner axes cross processes (`comm.check_layout`).
  """
  if mode not in OVERLAP_EXECUTORS:
    raise ValueError(f"diloco.overlap_executor must be one of {', '.join(OVERLAP_EXECUTORS)}, "
                     f"got {mode!r}")
  tx = getattr(algorithm, "tx", None)
  overlapped = isinstance(tx, StreamingDiLoCo) and bool(np.any(tx.schedule.delay > 0))
  works = overlapped and source.name in _THREAD_SOURCES
  if mode == "inline" or (mode == "auto" and not works):
    return "inline"
  if not works:
    why = ("gradients=pipeline keeps its state in grid layout" if overlapped else
           "only Streaming DiLoCo with diloco.overlap_steps (τ) >= 1 has an all-reduce to overlap")
    raise ValueError(f"diloco.overlap_executor=thread: {why}; use diloco.overlap_executor=inline "
                     "or auto")
  comm.check_layout(mesh)
  return "thread"


def start(choice: str, algorithm, mesh):
  """The loop's `Overlap` for `choose`'s answer (`thread` starts the executor's thread)."""
  return Threaded(algorithm.tx, mesh) if choice == "thread" else Inline()


def program_phase(delay, phase: Phase) -> Phase:
  """The phase a step's program runs with the thread: `phase` without the overlapped (τ ≥ 1)
  fragments' sends and merges, which the thread and `Threaded.after_step` run."""
  return Phase(tuple(p for p in phase.send if not delay[p]),
               tuple(p for p in phase.receive if not delay[p]))


class Threaded:
  """Streaming DiLoCo's overlapped fragments (τ ≥ 1) through a `comm.OuterCommExecutor`."""

  def __init__(self, tx: StreamingDiLoCo, mesh):
    self.tx = tx
    self.delay = tx.schedule.delay
    self.executor = comm.OuterCommExecutor(tx.codec, tx.codec_kernels, tx.axis_name, mesh)
    self._futures: dict = {}  # fragment p -> the future of its mean, while in flight
    self._deltas: dict = {}  # fragment p -> the compiled Δ_p program
    self._merges: dict = {}  # fragments merged together -> their compiled merge program
    self._due: list = []  # fragments the step just dispatched left for after_step to merge
    self._multiprocess = jax.process_count() > 1
    self._frags = None

  def _delta_program(self, p: int, frag):
    """(θ_R, φ, residual_R) -> (Δ_p per replica, a copy of the residual): no collective. The copy
    is the executor's own: the state's buffers are donated to the next step."""
    if p not in self._deltas:
      outer_gradient = self.tx.outer_gradient
      per_replica = jax.vmap(lambda local, outer: outer_gradient(frag, outer, local), in_axes=(0, None))
      self._deltas[p] = jax.jit(lambda params_r, outer, residual: (
          per_replica(params_r, outer), jax.tree.map(lambda x: x + 0, residual)))
    return self._deltas[p]

  def before_step(self, step: int, phase: Phase, state):
    """Submits the overlapped sends of `step`.

    Returns (the phase the step's program runs: `phase` without the overlapped sends and without
    the merges of fragments still in flight, which `after_step` runs; the state).
    """
    opt = state.opt_state
    if self._frags is None:  # from one replica's shapes (the parameters carry a leading [M])
      self._frags = self.tx.fragments(jax.eval_shape(lambda t: jax.tree.map(lambda x: x[0], t),
                                                     state.params))
    frags = self._frags
    sends = [p for p in phase.send if self.delay[p]]
    for p in sends:  # fragments in increasing order: the schedule order every process follows
      residual = opt.residuals[p] if self.tx.error_feedback else None
      delta_r, residual_copy = self._delta_program(p, frags[p])(state.params, opt.outer_params,
                                                                residual)
      key = None
      if self.tx.codec is not None and self.tx.codec.rounding == "stochastic":
        # As inline: fold_in(key(p), count), count = inner steps taken before this step.
        key = jax.random.fold_in(jax.random.key(p), step - 1)
      self._futures[p] = self.executor.submit(step, p, delta_r, residual_copy, key)
    # Overlapped merges leave the program: its inner step does not need the mean. Also a merge
    # without a future (after a resume the checkpoint's in-flight buffer holds the mean), so that
    # a resumed run rounds as the uninterrupted one.
    self._due = [p for p in phase.receive if self.delay[p]]
    return program_phase(self.delay, phase), state

  def after_step(self, state):
    """After the step's program is dispatched: waits on the futures of the merges it left out,
    writes their means into the state and runs their outer steps and merges (one program)."""
    if not self._due:
      return state
    due, self._due = tuple(self._due), []
    state = self._write(state, [p for p in due if p in self._futures])
    params, opt_state = self._merge_program(due, state)(state.params, state.opt_state)
    return state._replace(params=params, opt_state=opt_state)

  def _merge_program(self, due: tuple, state):
    """(params_R, opt_state) -> the same after `StreamingDiLoCo.merge_in_flight(due)` per replica:
    elementwise, no collective; the state keeps its layout (the next step's program expects it)."""
    if due not in self._merges:
      axes = self.tx.state_axes
      per_replica = jax.vmap(lambda params, opt: self.tx.merge_in_flight(due, opt, params),
                             in_axes=(0, axes), out_axes=(0, axes))
      layout = jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state))
      self._merges[due] = jax.jit(per_replica, out_shardings=layout, donate_argnums=(0, 1))
    return self._merges[due]

  def settle(self, state):
    """Every fragment in flight waited for and written into the state (its in-flight buffer, and
    its error-feedback residual). A resumed loop then has no future and merges the buffer."""
    return self._write(state, sorted(self._futures))

  def quiet(self) -> None:
    """With several processes, waits until the executor's collectives are done: the training
    thread's own cross-process collectives (metric gathers, checkpoints) must not interleave
    with them in a different order on another process."""
    if self._multiprocess:
      self.executor.drain()

  def close(self) -> None:
    self.executor.close()

  def _write(self, state, fragments):
    opt = state.opt_state
    in_flight, residuals = list(opt.in_flight), list(opt.residuals)
    for p in fragments:
      result = self._futures.pop(p).result()
      mean_r, new_residual = result if self.tx.error_feedback else (result, None)
      in_flight[p] = jax.tree.map(_first_row, mean_r, in_flight[p])
      if new_residual is not None:
        residuals[p] = jax.tree.map(_laid_out_as, new_residual, residuals[p])
    return state._replace(opt_state=opt._replace(in_flight=tuple(in_flight),
                                                 residuals=tuple(residuals)))


def _laid_out_as(value: jax.Array, like: jax.Array) -> jax.Array:
  """`value` with `like`'s sharding (what the compiled step expects)."""
  if value.sharding.is_equivalent_to(like.sharding, value.ndim):
    return value
  return jax.device_put(value, like.sharding)


def _first_row(rows: jax.Array, like: jax.Array) -> jax.Array:
  """`rows[0]` laid out as `like`, a leaf of the shared (unmapped) state.

  Every row of `rows` is the same mean, so each device's shard of row 0 is its shard of whichever
  row it holds: built from this process's own shards, no collective on the training thread (which
  with several processes could interleave with the executor's). Falls back to a resharding copy
  when the layouts do not line up (one process only).
  """
  want = like.sharding.addressable_devices_indices_map(like.shape)
  have = {s.device: s for s in rows.addressable_shards}
  pieces = []
  for device, index in want.items():
    shard = have.get(device)
    if shard is None or _normalized(shard.index[1:], rows.shape[1:]) != _normalized(index, like.shape):
      pieces = None
      break
    pieces.append(shard.data[0])
  if pieces is not None:
    return jax.make_array_from_single_device_arrays(like.shape, like.sharding, pieces)
  if not rows.is_fully_addressable:
    raise ValueError(f"the executor's mean (sharding {rows.sharding}) does not line up with the "
                     f"in-flight buffer's ({like.sharding}) on this process's devices")
  return distributed.replicated_array(np.asarray(rows[0]), like.sharding)


def _normalized(index, shape) -> tuple:
  return tuple(s.indices(n) for s, n in zip(index, shape))
