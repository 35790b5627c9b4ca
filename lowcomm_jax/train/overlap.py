"""The carriers of the outer communication, as the Trainer's loop runs them: in the step's program,
on a thread of its own, or through an elastic run's syncer.

`outer.overlap_executor` picks how a plan (`comm.Plan`) with τ ≥ 1 travels (docs/overlap.md):

  inline  its collective sits in the send step's own program (`comm.dispatch.carry_phase`), issued
          by the training thread: on XLA:CPU the steps dispatched after it wait for every peer.
  thread  `comm.OuterCommExecutor`: on the send step the loop computes the algorithm's `local`
          trees from the parameters entering the step (a small program without collectives),
          submits each with its plan and runs the step without that send. The consuming step's
          program runs without the consumption (its forward, backward and inner update do not
          need the result: they overlap the collective too); after dispatching it, the loop waits
          on those futures only, writes the results into the state's `comm.CommState` and runs the
          algorithm's `apply` as a program of its own (no collective).
  auto    (default) thread where it works: an algorithm with a plan of τ ≥ 1 on the `replicas` or
          `skippipe` gradient sources; inline elsewhere (nothing to overlap, or the pipeline's
          grid layout).

An elastic learner's loop carries every plan through the syncer instead (`Remote`, one replica,
the plans of kind mean, compressed_mean and sparse_gather: `comm.remote`).

The loop knows only the plan interface (`comm.plan.OuterStep` plus `phases`, `consumes` and
`without_delayed`), not the algorithm. It sees a `Carrier`: `before_step` (the phase the step's
program runs), `after_step` (the state once the consumptions left out of that program ran),
`position` (the step that state stands at: later only where `Remote` rejoined the syncer),
`settle` (every future written into the state: before a checkpoint and at the end, so a
checkpoint holds the in-flight result exactly as the inline state does), `quiet` (no collective
of the executor running: before the training thread's own cross-process work, e.g. metric
gathers) and `close`.

Same results as inline within the float32 rounding of the outer step (tests/test_overlap_loop.py):
the thread's apply program runs the outer step on the parameters the step's program wrote, inline
runs it inside the step, where XLA fuses it with the inner update; the two round differently at the
ulp scale.
"""

from __future__ import annotations

import jax
import numpy as np

from lowcomm_jax import comm, distributed
from lowcomm_jax.comm import dispatch, remote
from lowcomm_jax.optim.schedule import Phase, without_delayed

OVERLAP_EXECUTORS = ("auto", "thread", "inline")
_THREAD_SOURCES = ("replicas", "skippipe")  # per-replica state with a leading [M] axis
_THREAD_KINDS = ("mean", "compressed_mean", "sparse_gather")  # the same result on every replica


class Carrier:
  """The seam every carrier fills (the module doc); this one does nothing around a step."""

  executor = None

  def before_step(self, step: int, phase, state):
    return phase, state

  def after_step(self, state):
    return state

  def position(self, step: int) -> int:
    """The step the state stands at once `step`'s `after_step` ran: `step`, or a later one where
    the carrier replaced the state (a rejoining learner that caught up with the others)."""
    return step

  def settle(self, state):
    return state

  def quiet(self) -> None:
    pass

  def close(self) -> None:
    pass


class Inline(Carrier):
  """Every collective in the step's own program: nothing to do around it."""


def choose(mode: str, algorithm, source, mesh) -> str:
  """"thread" or "inline": what `outer.overlap_executor=mode` means for this algorithm, gradient
  source and mesh (checked in the Trainer's constructor, before any compute).

  Raises:
    ValueError: an unknown mode (naming the allowed ones); `thread` where it cannot work (naming
      why); `thread` on a mesh whose inner axes cross processes (`comm.check_layout`).
  """
  if mode not in OVERLAP_EXECUTORS:
    raise ValueError(f"outer.overlap_executor must be one of {', '.join(OVERLAP_EXECUTORS)}, "
                     f"got {mode!r}")
  tx = getattr(algorithm, "tx", None)
  plans = [plan for phase in getattr(tx, "phases", ()) for plan in _plans(tx, phase).values()]
  overlapped = any(plan.delay for plan in plans)
  carried = overlapped and all(plan.kind in _THREAD_KINDS for plan in plans if plan.delay)
  works = carried and source.name in _THREAD_SOURCES
  if mode == "inline" or (mode == "auto" and not works):
    return "inline"
  if not works:
    why = ("gradients=pipeline keeps its state in grid layout" if carried else
           "only Streaming DiLoCo or SparseLoCo with outer.overlap_steps (τ) >= 1 has a "
           "collective to overlap")
    raise ValueError(f"outer.overlap_executor=thread: {why}; use outer.overlap_executor=inline "
                     "or auto")
  comm.check_layout(mesh)
  return "thread"


def start(choice: str, algorithm, mesh):
  """The loop's `Carrier` for `choose`'s answer (`thread` starts the executor's thread)."""
  return Threaded(algorithm.tx, mesh) if choice == "thread" else Inline()


def _plans(tx, phase) -> dict:
  return tx.plans(phase) if isinstance(tx, comm.OuterStep) else {}


def program_phase(delay, phase: Phase) -> Phase:
  """Streaming DiLoCo's phase as a step's program runs it with the thread (`without_delayed`)."""
  return without_delayed(delay, phase)


def local_trees(tx, phase, names: tuple):
  """(θ_R, opt_state) -> (each plan name's tree per replica, a copy of its error-feedback residual
  per replica): what a carrier outside the step's program sends, the algorithm's `local` of the
  phase, with no collective. The copy is the carrier's own: the state's buffers are donated to the
  next step."""

  def trees(params_r, opt):
    per_replica = jax.vmap(lambda params, state: tx.local(state, params, phase),
                           in_axes=(0, tx.state_axes))(params_r, opt)
    residuals = {n: jax.tree.map(lambda x: x + 0, opt.comm.residuals[n])
                 for n in names if n in opt.comm.residuals}
    return {n: per_replica[n] for n in names}, residuals

  return trees


class Threaded(Carrier):
  """An algorithm's plans with τ ≥ 1 through a `comm.OuterCommExecutor`."""

  def __init__(self, tx, mesh):
    self.tx = tx
    self.executor = comm.OuterCommExecutor(axis_name=tx.axis_name, mesh=mesh)
    self._futures: dict = {}  # plan name -> the future of its result, while in flight
    self._locals: dict = {}  # phase -> the compiled program of its delayed plans' trees
    self._applies: dict = {}  # (phase, names) -> the compiled apply program
    self._due: tuple = ()  # (phase, names) the step just dispatched left for after_step
    self._multiprocess = jax.process_count() > 1
    self._delayed_names = {n for ph in tx.phases for n, p in tx.plans(ph).items() if p.delay}

  def _delayed(self, phase) -> dict:
    return {n: p for n, p in self.tx.plans(phase).items() if p.delay}

  def _local_program(self, phase, names: tuple):
    """`local_trees` of the phase's delayed sends, compiled once per phase."""
    if phase not in self._locals:
      self._locals[phase] = jax.jit(local_trees(self.tx, phase, names))
    return self._locals[phase]

  def before_step(self, step: int, phase, state):
    """Submits the delayed (τ ≥ 1) sends of `step`.

    Returns (the phase the step's program runs: `phase` without the delayed sends and without the
    consumptions of delayed plans, which `after_step` runs; the state).
    """
    sends = self._delayed(phase)
    if sends:
      trees, residuals = self._local_program(phase, tuple(sends))(state.params, state.opt_state)
      for name, plan in sends.items():  # the algorithm's order: the same on every process
        # as inline: the key folds in the inner steps taken before this step
        key = dispatch.plan_key(plan, step - 1)
        self._futures[name] = self.executor.submit(step, name, trees[name], residuals.get(name),
                                                   key, plan=plan)
    # Delayed consumptions leave the program: its inner step does not need the result. Also one
    # without a future (after a resume the checkpoint's in-flight buffer holds it), so that a
    # resumed run rounds as the uninterrupted one.
    due = tuple(n for n in self.tx.consumes(phase) if n in self._delayed_names)
    self._due = (phase, due) if due else ()
    return self.tx.without_delayed(phase), state

  def after_step(self, state):
    """After the step's program is dispatched: waits on the futures of the consumptions it left
    out, writes their results into the state and runs the algorithm's apply (one program)."""
    if not self._due:
      return state
    (phase, due), self._due = self._due, ()
    state = self._write(state, [n for n in due if n in self._futures])
    params, opt_state = self._apply_program(phase, due, state)(state.params, state.opt_state)
    return state._replace(params=params, opt_state=opt_state)

  def _apply_program(self, phase, due: tuple, state):
    """(params_R, opt_state) -> the same after the algorithm's apply of `due` per replica:
    elementwise, no collective; the state keeps its layout (the next step's program expects it)."""
    if (phase, due) not in self._applies:
      tx, axes = self.tx, self.tx.state_axes
      apply = lambda params, opt: tx.apply(opt, params, {n: opt.comm.in_flight[n] for n in due},
                                           phase)
      per_replica = jax.vmap(apply, in_axes=(0, axes), out_axes=(0, axes))
      layout = jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state))
      self._applies[(phase, due)] = jax.jit(per_replica, out_shardings=layout,
                                            donate_argnums=(0, 1))
    return self._applies[(phase, due)]

  def settle(self, state):
    """Every plan in flight waited for and written into the state (its in-flight buffer, and its
    error-feedback residual). A resumed loop then has no future and applies the buffer."""
    return self._write(state, list(self._futures))

  def quiet(self) -> None:
    """With several processes, waits until the executor's collectives are done: the training
    thread's own cross-process collectives (metric gathers, checkpoints) must not interleave
    with them in a different order on another process."""
    if self._multiprocess:
      self.executor.drain()

  def close(self) -> None:
    self.executor.close()

  def _write(self, state, names):
    opt = state.opt_state
    in_flight, residuals = dict(opt.comm.in_flight), dict(opt.comm.residuals)
    for name in names:
      result = self._futures.pop(name).result()
      mean_r, new_residual = result if name in residuals else (result, None)
      in_flight[name] = jax.tree.map(_first_row, mean_r, in_flight[name])
      if new_residual is not None:
        residuals[name] = jax.tree.map(_laid_out_as, new_residual, residuals[name])
    return state._replace(opt_state=opt._replace(comm=comm.CommState(in_flight, residuals)))


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
    if shard is None or _normalized(shard.index[1:], rows.shape[1:]) != _normalized(
      index, like.shape
    ):
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


class Remote(Carrier):
  """Every plan of the algorithm carried by a syncer: an elastic learner's loop (one replica).

  At a send the trees of the algorithm's `local` are encoded by their plan's codec
  (`comm.remote.encode`; with error feedback the new residual goes into the state's `CommState`)
  and handed to `link.send(step, name, payload)`; `link.receive(handle)` gives the syncer's reply,
  the mean of what the round merged (float32), and the algorithm's `apply` runs on it as a program
  of its own, as `Threaded` does with its futures. A plan of τ = 0 is sent after the step's
  program (from the parameters it wrote) and waited for at once; one of τ ≥ 1 is sent before the
  step's program (from the parameters entering it) and waited for after step s + τ. The step's
  program runs without any plan (`program_phase`). A consumption whose send this loop never made
  (the learner joined after it) is left out, except with eager outer updates: every sync step runs
  the worker's outer step, on the in-flight buffer (zeros before the first mean lands or after a
  rejoin) where no reply is due.

  A reply may say the syncer did not take the learner's Δ as sent (`link.receive` raises
  `Rejoin`): the replies still in flight are dropped and the state is the one `link.rejoin(state,
  step)` returns, with the step it stands at (φ and the outer state from the syncer; a later step
  when the learner fell behind the others, its data moved there by the link). The loop goes on
  from that step (`position`).
  """

  executor = None

  def __init__(self, tx, link):
    check_remote(tx)
    self.tx, self.link = tx, link
    self._handles: dict = {}  # plan name -> the link's handle of its reply, while in flight
    self._locals: dict = {}  # (phase, names) -> the compiled program of their trees
    self._applies: dict = {}  # (phase, names) -> the compiled apply program
    self._step, self._phase = 0, None
    self._moved_to = None  # the step a rejoin moved the state to, until the loop reads it

  @staticmethod
  def program_phase(tx, phase):
    """The phase a step's program runs with this carrier: `phase` without any plan."""
    return program_phase((1,) * tx.schedule.num_fragments, phase)

  def before_step(self, step: int, phase, state):
    self._step, self._phase = step, phase
    sends = {n: p for n, p in self.tx.plans(phase).items() if p.delay}
    if sends:
      state = self._send(step, phase, sends, state)
    return self.program_phase(self.tx, phase), state

  def after_step(self, state):
    step, phase = self._step, self._phase
    sends = {n: p for n, p in self.tx.plans(phase).items() if not p.delay}
    if sends:
      state = self._send(step, phase, sends, state)
    # eager: every sync step runs its outer step, on the in-flight buffer where no reply is due
    # (zeros before the first mean lands, or after a rejoin)
    held = state.opt_state.comm.in_flight if getattr(self.tx, "eager", False) else {}
    due = tuple(n for n in self.tx.consumes(phase) if n in self._handles or n in held)
    if not due:
      return state
    try:
      # (a held buffer as a host copy: the state's own buffers are donated to the program)
      incoming = {n: self.link.receive(self._handles.pop(n)) if n in self._handles else
                  jax.device_get(held[n]) for n in due}
    except Rejoin:
      return self._rejoin(state, step)
    params, opt_state = self._apply_program(phase, due, state)(state.params, state.opt_state,
                                                               incoming)
    return state._replace(params=params, opt_state=opt_state)

  def _send(self, step: int, phase, plans: dict, state):
    trees, residuals = self._local_program(phase, tuple(plans))(state.params, state.opt_state)
    trees, residuals = jax.device_get((trees, residuals))
    kept = dict(state.opt_state.comm.residuals)
    for name, plan in plans.items():  # the algorithm's order
      first = lambda tree: jax.tree.map(lambda x: x[0], tree)
      residual = first(residuals[name]) if name in residuals else None
      payload, new_residual = remote.encode(plan, name, first(trees[name]), residual)
      self._handles[name] = self.link.send(step, name, payload)
      if new_residual is not None:
        kept[name] = jax.tree.map(lambda x, like: jax.device_put(x[None], like.sharding),
                                  new_residual, kept[name])
    opt = state.opt_state
    return state._replace(opt_state=opt._replace(comm=opt.comm._replace(residuals=kept)))

  def _local_program(self, phase, names: tuple):
    """`local_trees` of `names`, compiled once per (phase, names)."""
    if (phase, names) not in self._locals:
      self._locals[(phase, names)] = jax.jit(local_trees(self.tx, phase, names))
    return self._locals[(phase, names)]

  def _apply_program(self, phase, due: tuple, state):
    """(params_R, opt_state, the replies) -> the same after the algorithm's apply of `due`."""
    if (phase, due) not in self._applies:
      tx, axes = self.tx, self.tx.state_axes
      apply = lambda params, opt, incoming: tx.apply(opt, params, incoming, phase)
      per_replica = jax.vmap(apply, in_axes=(0, axes, None), out_axes=(0, axes))
      layout = jax.tree.map(lambda x: x.sharding, (state.params, state.opt_state))
      self._applies[(phase, due)] = jax.jit(per_replica, out_shardings=layout,
                                            donate_argnums=(0, 1))
    return self._applies[(phase, due)]

  def position(self, step: int) -> int:
    moved, self._moved_to = self._moved_to, None
    return step if moved is None else moved

  def _rejoin(self, state, step: int):
    self._handles.clear()
    state, self._moved_to = self.link.rejoin(state, step)
    return state

  def settle(self, state):
    """Every reply in flight waited for and written into the state's in-flight buffers."""
    opt = state.opt_state
    in_flight = dict(opt.comm.in_flight)
    for name in list(self._handles):
      try:
        reply = self.link.receive(self._handles.pop(name))
      except Rejoin:
        return self._rejoin(state, self._step)
      if name in in_flight:
        in_flight[name] = jax.tree.map(lambda x, like: jax.device_put(x, like.sharding), reply,
                                       in_flight[name])
    return state._replace(opt_state=opt._replace(comm=opt.comm._replace(in_flight=in_flight)))

  def quiet(self) -> None:
    pass

  def close(self) -> None:
    pass


class Rejoin(Exception):
  """A remote link's reply: the syncer did not take this learner's Δ as sent (dropped, or merged
  from an older φ than the round's); `Remote` asks the link for the state to go on from."""


def check_remote(tx) -> None:
  """Refuses, in one line, an algorithm whose plans a syncer cannot carry."""
  kinds = {plan.kind for plan in _all_plans(tx)}
  if not isinstance(tx, comm.OuterStep) or not kinds or not kinds <= set(remote.REMOTE_KINDS):
    raise ValueError(f"a syncer carries plans of kind {', '.join(remote.REMOTE_KINDS)} "
                     f"(DiLoCo, Streaming DiLoCo, SparseLoCo); this algorithm's are "
                     f"{sorted(kinds) or 'none'}")


def _all_plans(tx) -> list:
  return [plan for phase in getattr(tx, "phases", ()) for plan in _plans(tx, phase).values()]
