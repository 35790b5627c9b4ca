"""Streaming DiLoCo as an optax-style transformation over a bound replica axis; DiLoCo is one
setting.

Each replica m runs the inner optimizer on its own data. Fragment p of the
parameters keeps a global copy φ_p (float32) and its own outer optimizer
state. When the schedule says so (see `schedule.py`), the outer gradient
Δ_p = φ_p − θ_{m,p} is averaged over replicas, the outer optimizer steps
φ_p ← OuterOpt(φ_p, mean_m Δ_p), and the replica's fragment becomes
θ_{m,p} ← α·θ_{m,p} + (1 − α)·φ_p (docs/algorithms.md §1.2(c)). Vanilla DiLoCo is one
fragment, τ = 0, α = 0: the same code.

Use it inside `jax.vmap(..., axis_name="replica")` (simulated replicas) or
jit over a mesh with a `replica` axis, with `state_axes` as the vmap axes of
the state: the step count, φ and the outer states are the same on every
replica (unmapped), the inner optimizer state is per replica (mapped).

Per-fragment state is kept as the fragment's sub-tree of the parameter tree
(`fragments.extract`: the parameters' own nested dicts and path keys, the
fragment's arrays or layer slices, `optax.MaskedNode()` elsewhere), so it takes
the parameters' shardings and `optax.tree_map_params(tx, f, state)` maps `f`
over it (pass `is_leaf=lambda x: isinstance(x, optax.MaskedNode)` when mapping
together with a parameter-shaped tree, as for `optax.masked`).

`update(grads, state, params, phase=None, **extra_args)`: `extra_args` go to
the inner optimizer (e.g. `value=` for `optax.polyak_sgd`). With `phase=None` the step count
picks the phase with `lax.switch` (one branch per distinct phase, so only the
due fragment's collective runs when the count is unmapped). The Trainer
passes the phase read on the host instead, which compiles one program per
phase and leaves non-sync steps with no collective at all.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax import checks, codecs, comm, mesh as mesh_lib
from lowcomm_jax.comm import dispatch
from lowcomm_jax.optim import fragments as frag_lib, schedule as schedule_lib
from lowcomm_jax.optim.outer import check_transformation, outer_nesterov


class StreamingDiLoCoState(NamedTuple):
  """Per-fragment fields are tuples over fragments p of sub-trees keyed like the parameters."""

  count: jax.Array  # int32[]: inner steps taken (same on every replica)
  inner_state: Any  # the inner optimizer's state, per replica
  outer_params: Any  # φ: the global parameters, float32, the parameters' tree
  outer_states: tuple  # per fragment: the outer optimizer's state of φ_p (its sub-tree)
  comm: comm.CommState  # by plan name "fragment p": the mean in flight (τ ≥ 1), the residual
  nonfinite: jax.Array  # int32[F]: outer steps refused because the averaged Δ held NaN or inf
  # eager only, per replica: per slot (fragment p's lane j, `schedule.py`) the worker's own Δ_p of
  # the last outer step sent in that lane (what it sends next, and what it takes out of the mean of
  # that send when it lands); () otherwise
  own_deltas: tuple = ()


FragmentRule = Callable[[Any], tuple[frag_lib.Fragment, ...]]
# 1 (the whole model), P (layer fragments), a regex table [(regex, index), ...] or a rule params ->
# fragments
FragmentsArg = int | frag_lib.Rules | FragmentRule


class StreamingDiLoCo:
  """init/update like an optax transformation, plus the schedule and the vmap axes of the state.

  `schedule` is a `FragmentSchedule`, or a function of the number of fragments that makes one:
  then the first parameters seen (`init`, `fragments`) fix it, from what `fragments` gives.
  """

  def __init__(self, inner, outer,
               schedule: schedule_lib.FragmentSchedule | Callable[[int],
                                                                  schedule_lib.FragmentSchedule],
               fragments: FragmentRule, axis_name: str = mesh_lib.REPLICA, codec=None,
               error_feedback: bool = False, codec_kernels: str = "auto",
               naive_delay: bool = False):
    check_transformation(inner, "inner optimizer")
    check_transformation(outer, "outer optimizer")
    if error_feedback and codec is None:
      raise ValueError("outer.error_feedback needs a lossy outer.codec (e3m0, e2m1, int4, int8, "
                       "bf16)")
    self.inner, self.outer, self.axis_name = optax.with_extra_args_support(inner), outer, axis_name
    self.codec, self.error_feedback = codec, error_feedback
    # refuses an unknown mode, or pallas where it cannot compile, here, before any tracing
    codecs.kernel_options(codec_kernels, codec)
    self.codec_kernels = codec_kernels
    self._fragments = fragments
    self._schedule = None
    self._make_schedule = schedule
    if isinstance(schedule, schedule_lib.FragmentSchedule):
      self._set_schedule(schedule)
    self.num_replicas = None  # M, set by `init_replicated` (the eager proxy's 1/M)
    # the eager proxy's M where the replicas here are not all the workers (an elastic learner is
    # one replica of elastic.num_learners); None: `num_replicas`
    self.eager_workers = None
    # with the eager schedule (τ = H): the landed mean applied as it is, no proxy (the baseline)
    self.naive_delay = bool(naive_delay)
    self._set_state_axes()

  def _set_state_axes(self) -> None:
    # eager: each worker steps its own φ with its own proxy, so φ and the outer states are per
    # replica
    shared = 0 if self.eager else None
    self.state_axes = StreamingDiLoCoState(count=None, inner_state=0, outer_params=shared,
                                           outer_states=shared, comm=comm.COMM_STATE_AXES,
                                           nonfinite=shared, own_deltas=0)

  @property
  def eager(self) -> bool:
    return self._schedule is not None and bool(self._schedule.eager.any())

  def _set_schedule(self, schedule: schedule_lib.FragmentSchedule) -> None:
    self._schedule = schedule
    if schedule.eager.any() and self.error_feedback:
      raise ValueError("outer.eager does not compose with error feedback: the worker takes its "
                       "own Δ out of the landed mean, which holds Δ's encoding plus the resent "
                       "residual")
    if hasattr(self, "state_axes"):
      self._set_state_axes()
    self.phases, self._table, self._s0 = schedule_lib.phase_table(schedule)
    kind = "mean" if self.codec is None else self.plan_kind
    # slot q's plan (fragment p = q % F, lane j = q // F); stochastic rounding keys fold the
    # fragment in (seed p)
    f = schedule.num_fragments
    self._plans = [comm.Plan(kind, self.codec, int(schedule.delay[q % f]), self.error_feedback,
                             self.feedback_decay, self.codec_kernels, seed=q % f)
                   for q in range(schedule.num_slots)]
    self._slots = {self.slot_name(q): q for q in range(schedule.num_slots)}

  plan_kind = "compressed_mean"  # how a fragment's Δ travels when a codec is set
  feedback_decay = 1.0  # β: e ← β·e + Δ before encoding

  @staticmethod
  def plan_name(p: int) -> str:
    return f"fragment {p}"

  def fragment_of(self, name: str) -> int:
    """The fragment p of plan `name` (a slot's: lane j of p)."""
    return self._slots[name] % self.schedule.num_fragments

  def slot_name(self, q: int) -> str:
    """Slot q's plan name: fragment p's (`plan_name`) for lane 0, "fragment p, lane j" else."""
    p, j = q % self.schedule.num_fragments, q // self.schedule.num_fragments
    return self.plan_name(p) + (f", lane {j}" if j else "")

  # -- the outer step as plans (`comm.plan.OuterStep`) -------------------------------------------
  def plans(self, phase) -> dict:
    """{"fragment p": its Plan} for the fragments whose Δ_p this phase's program sends."""
    return {self.slot_name(q): self._plans[q] for q in phase.send}

  def consumes(self, phase) -> tuple:
    return tuple(self.slot_name(q) for q in phase.receive)

  def without_delayed(self, phase) -> schedule_lib.Phase:
    """`phase` without its overlapped (τ ≥ 1) sends and merges (the communication thread's)."""
    return schedule_lib.without_delayed(self.schedule.delay, phase)

  def local(self, state, params, phase) -> dict:
    """Δ_p = φ_p − θ_p of every fragment p this phase sends, from `params`; eager: the worker's Δ_p
    kept by its last outer step (φ_p and θ_p have moved since)."""
    if self.eager:
      return {self.slot_name(q): state.own_deltas[q] for q in phase.send}
    frags = self.fragments(params)
    return {self.plan_name(p): self.outer_gradient(frags[p], state.outer_params, params)
            for p in phase.send}

  def apply(self, state, params, incoming: dict, phase=None):
    """(params, state) after the outer step and merge of each fragment in `incoming` (its averaged
    Δ_p by plan name); elementwise, no collective."""
    del phase
    frags = self.fragments(params)
    means = {self._slots[name]: mean for name, mean in incoming.items()}  # by slot
    if self.eager:
      means, state = self._eager_proxies(frags, means, state, params)
    f = self.schedule.num_fragments
    means = {q % f: mean for q, mean in means.items()}  # by fragment: one lane lands at a time
    local, outer_params, outer_states, nonfinite = self._merge(
        frags, means, params, state.outer_params, state.outer_states, state.nonfinite)
    return local, state._replace(outer_params=outer_params, outer_states=outer_states,
                                 nonfinite=nonfinite)

  def _eager_proxies(self, frags, means: dict, state, params):
    """(the proxy Δ̃_p = mean_p − Δ_p'/M + Δ_p/M of each slot in `means`, the state keeping the
    fresh Δ_p in that slot): mean_p, landed now, holds every worker's Δ of the outer step D steps
    back (the slot's last send); this worker's own share Δ_p'/M of it was applied then, so it is
    replaced by its fresh Δ_p (docs/algorithms.md §1.7)."""
    workers = self.eager_workers or self.num_replicas
    if workers is None and not self.naive_delay:
      raise ValueError("outer.eager needs the number of workers M: call init_replicated(params, M)")
    own = list(state.own_deltas)
    proxies = {}
    for p, mean in means.items():  # p: the slot
      fresh = self.outer_gradient(frags[p % len(frags)], state.outer_params, params)
      if self.naive_delay:  # the previous outer step's mean, one outer step late, as it is
        proxies[p] = mean
      else:
        inv_m = 1.0 / workers
        proxies[p] = jax.tree.map(lambda a, o, f: a - inv_m * o + inv_m * f, mean, own[p], fresh)
      own[p] = fresh
    return proxies, state._replace(own_deltas=tuple(own))

  @property
  def schedule(self) -> schedule_lib.FragmentSchedule:
    if self._schedule is None:
      raise ValueError("this StreamingDiLoCo takes its number of fragments from a fragment rule "
                       "applied to the parameters: call init(params) or fragments(params) first")
    return self._schedule

  def fragments(self, params) -> tuple[frag_lib.Fragment, ...]:
    frags = self._fragments(params)
    if self._schedule is None:
      self._set_schedule(self._make_schedule(len(frags)))
    if len(frags) != self.schedule.num_fragments:
      raise ValueError(f"the fragment rule gave {len(frags)} fragments but the schedule has "
                       f"{self.schedule.num_fragments} rows")
    frag_lib.check_cover(frags, params)
    return frags

  def phase_at(self, step: int) -> schedule_lib.Phase:
    """The phase of inner step `step` (1-based)."""
    return schedule_lib.phase_at(self.schedule, step)

  def _sub_trees(self, params) -> list:
    """Each fragment's sub-tree of `params`; a tree without leaves (optax's placeholder in
    `tree_map_params`) stands for every fragment's."""
    if not jax.tree.leaves(params):
      return [params] * self.schedule.num_fragments
    return [frag_lib.extract(f, params) for f in self.fragments(params)]

  def init(self, params) -> StreamingDiLoCoState:
    outer_params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    sub_trees = self._sub_trees(outer_params)
    zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
    outer_states = tuple(self.outer.init(t) for t in sub_trees)
    names = [self.plan_name(p) for p in range(len(sub_trees))]
    slots = [(self.slot_name(q), sub_trees[q % len(sub_trees)])
             for q in range(self.schedule.num_slots)]
    in_flight = {n: zeros(t) for n, t in slots if self._plans[self._slots[n]].delay}
    residuals = {n: zeros(t) for n, t in zip(names, sub_trees)} if self.error_feedback else {}
    own_deltas = tuple(zeros(t) for _, t in slots) if self.eager else ()
    return StreamingDiLoCoState(jnp.zeros((), jnp.int32), self.inner.init(params), outer_params,
                                outer_states, comm.CommState(in_flight, residuals),
                                jnp.zeros((len(sub_trees),), jnp.int32), own_deltas)

  def init_replicated(self, params, num_replicas: int):
    """(params_R, state): every replica starts from `params`, with its own inner optimizer state."""
    state = self.init(params)
    self.num_replicas = num_replicas
    stack = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (num_replicas,) + x.shape), t)
    mapped = lambda axis, t: stack(t) if axis == 0 else t
    state = state._replace(**{f: mapped(getattr(self.state_axes, f), getattr(state, f))
                              for f in ("inner_state", "outer_params", "outer_states",
                                        "nonfinite", "own_deltas")})
    return stack(params), state._replace(
        comm=state.comm._replace(residuals=stack(state.comm.residuals)))

  def update(self, grads, state: StreamingDiLoCoState, params, phase=None, **extra_args):
    if phase is not None:
      return self._apply(schedule_lib.Phase(*phase), grads, state, params, **extra_args)
    s = state.count + 1
    index = jnp.where(s < self._s0, s, self._s0 + (s - self._s0) % self.schedule.cycle)
    branch = jnp.asarray(self._table)[index - 1]
    branches = [functools.partial(self._apply, ph, **extra_args) for ph in self.phases]
    return jax.lax.switch(branch, branches, grads, state, params)

  @staticmethod
  def outer_gradient(frag, outer_params, local_params):
    """Δ_p = φ_p − θ_p in float32, fragment p's sub-tree (what its all-reduce averages)."""
    return jax.tree.map(lambda g, l: g.astype(jnp.float32) - l.astype(jnp.float32),
                        frag_lib.extract(frag, outer_params), frag_lib.extract(frag, local_params))

  def _apply(self, phase: schedule_lib.Phase, grads, state: StreamingDiLoCoState, params,
             **extra_args):
    # Overlapped sends read the parameters entering this step, so they do not wait for its backward.
    _, state = dispatch.carry_phase(self, state, params, phase, self.axis_name, delayed=True)
    inner_updates, inner_state = self.inner.update(grads, state.inner_state, params, **extra_args)
    local = optax.apply_updates(params, inner_updates)
    carried, state = dispatch.carry_phase(self, state, local, phase, self.axis_name, delayed=False)
    local, state = self.apply(state, local, dispatch.incoming(self, state, phase, carried))
    new_state = state._replace(count=state.count + 1, inner_state=inner_state)
    return jax.tree.map(lambda n, o: n - o, local, params), new_state

  def _merge(self, frags, means: dict, local, outer_params, outer_states, nonfinite):
    """The outer step of each fragment p in `means` (its averaged Δ_p) and its merge into `local`.

    Returns (local, outer_params, outer_states, nonfinite)."""
    outer_states = list(outer_states)
    for p, mean_delta in means.items():
      global_p, outer_states[p], finite = self.outer_step(
          mean_delta, frag_lib.extract(frags[p], outer_params), outer_states[p])
      nonfinite = nonfinite.at[p].add(jnp.where(finite, 0, 1))
      merged = self.merge(p, frag_lib.extract(frags[p], local), global_p, finite)
      outer_params = frag_lib.insert(frags[p], outer_params, global_p)
      local = frag_lib.insert(frags[p], local, merged)
    return local, outer_params, tuple(outer_states), nonfinite

  def outer_step(self, mean_delta, global_p, outer_state):
    """φ_p ← OuterOpt(φ_p, Δ_p) for one fragment's sub-trees: (new φ_p, new outer state, finite).

    A NaN or inf in the averaged outer gradient never reaches φ: the step is refused (φ_p and its
    outer state kept, `finite` False). The elastic syncer runs the same step on its host copy of φ.
    """
    outer_updates, new_outer_state = self.outer.update(mean_delta, outer_state, global_p)
    finite = codecs.all_finite(mean_delta)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return (keep(optax.apply_updates(global_p, outer_updates), global_p),
            keep(new_outer_state, outer_state), finite)

  def merge(self, p: int, local_p, global_p, finite=True):
    """θ_p ← α_p·θ_p + (1 − α_p)·φ_p (fragment p's sub-trees); after a refused outer step the
    replica restarts the fragment from φ_p."""
    alpha = float(self.schedule.alpha[p])
    return jax.tree.map(
        lambda l,
        g: jnp.where(finite, alpha * l.astype(jnp.float32) + (1 - alpha) * g, g).astype(l.dtype),
        local_p, global_p)


def _resolve_fragments(fragments: FragmentsArg, pattern: str, non_block: str) -> FragmentRule:
  if callable(fragments):
    return fragments
  if isinstance(fragments, (tuple, list)):
    rules = tuple(fragments)
    return lambda params: frag_lib.rule_fragments(params, rules)
  if fragments == 1:
    return frag_lib.whole_model
  return lambda params: frag_lib.layer_fragments(params, fragments, pattern, non_block)


def streaming_diloco(inner: optax.GradientTransformation,
                     outer: optax.GradientTransformation | None = None,
                     sync_every: int = 100, fragments: FragmentsArg = 1, overlap_steps: int = 0,
                     merge_alpha: float = 0.0, staggered: bool = True,
                     fragment_pattern: str = "strided",
                     non_block_fragment: str = "own", axis_name: str = mesh_lib.REPLICA,
                     codec=None, error_feedback: bool = False,
                     codec_kernels: str = "auto",
                     overlap_anchor: str = "send", eager: bool = False,
                     naive_delay: bool = False) -> StreamingDiLoCo:
  """Streaming DiLoCo (arXiv 2501.18512).

  Args:
    inner: the inner optimizer (e.g. `optax.adamw`); its state stays local and is never reset.
    outer: the outer optimizer, applied per fragment to Δ = φ − θ; default Nesterov SGD (0.7, 0.9).
    sync_every: H, inner steps between two syncs of the same fragment.
    fragments: 1 (the whole model); an int P (P block fragments by `fragment_pattern`, plus the
      non-block parameters by `non_block_fragment`); a regex table `[(regex, index), ...]` over
      parameter paths (`fragments.rule_fragments`, first match wins); or a callable params -> tuple
      of Fragments, whose count fixes the schedule's rows when `init` first sees the parameters.
    overlap_steps: τ, inner steps the all-reduce of a fragment overlaps before it is applied.
    merge_alpha: α, weight of the local parameters when the global fragment is merged in.
    overlap_anchor: "send" (sent at the nominal sync step, merged τ steps later; the paper's) or
      "apply" (sent τ steps before the nominal step, merged at it; torchft's), see `schedule.py`.
    staggered: offsets p·H/P (True) or every fragment at the same step (False).
    axis_name: the bound replica axis.
    codec: None for a float32 all-reduce (`lax.pmean`), or a codec name / `lowcomm_jax.codecs`
      Codec: outer gradients travel encoded through a compressed mean that accumulates in float32.
    error_feedback: keep each replica's quantization residual per fragment and add it to that
      fragment's next outer gradient (needs a codec).
    codec_kernels: how the codec encodes and decodes on the wire: "reference" (jnp), "pallas"
      (the Pallas kernels; interpreted on CPU, bit-identical to the reference), "pallas_mosaic_gpu"
      / "pallas_triton" ("pallas" with that GPU kernel) or "auto" (Pallas where the platform
      compiles them, GPU/TPU; the reference elsewhere); see `codecs.kernel_options`.
    eager: eager outer updates (arXiv 2502.12996, docs/algorithms.md §1.7): needs τ = D·H with
      D = 1 or 2; each fragment's mean overlaps D whole outer phases while every worker runs its
      outer step at once with a proxy of its own fresh Δ and the others' Δ of D outer steps back;
      φ and the outer states are then per worker (`state_axes` 0).
    naive_delay: the eager paper's baseline on the same schedule (τ = D·H): at every sync step each
      worker applies the mean that landed, D outer steps late, as it is (its fresh Δ is only sent),
      and restarts from that φ.
  """
  outer = outer if outer is not None else outer_nesterov()
  schedule, resolve = schedule_and_fragments(sync_every, fragments, overlap_steps, merge_alpha,
                                             staggered, fragment_pattern, non_block_fragment,
                                             overlap_anchor, eager or naive_delay)
  if isinstance(codec, str):
    codec = codecs.get_codec(codec)
  return StreamingDiLoCo(inner, outer, schedule, resolve, axis_name, codec, error_feedback,
                         codec_kernels, naive_delay)


def schedule_and_fragments(sync_every: int, fragments: FragmentsArg, overlap_steps: int,
                           merge_alpha: float, staggered: bool, fragment_pattern: str,
                           non_block_fragment: str, overlap_anchor: str, eager: bool = False):
  """(the schedule, or the function of the fragment count that makes it; the fragment rule), as
  `streaming_diloco` takes them. Bad options fail here, before any compute, naming the `outer`
  keys."""
  # now, even when a callable's fragment count is known only at init
  checks.sync_every(sync_every, "outer.sync_every")
  resolve = _resolve_fragments(fragments, fragment_pattern, non_block_fragment)
  schedule = functools.partial(schedule_lib.make_schedule, sync_every=sync_every,
                               overlap_steps=overlap_steps, merge_alpha=merge_alpha,
                               staggered=staggered,
                               overlap_anchor=overlap_anchor, eager=eager)
  if not callable(fragments):  # the rows are known now
    schedule = schedule(count_fragments(fragments, non_block_fragment))
  return schedule, resolve


def count_fragments(fragments: int | frag_lib.Rules, non_block: str) -> int:
  """Rows of the schedule: 1 for the whole model, P block fragments (+1 when non_block="own"), or
  the number of fragments of a regex table. A callable rule has no count before it sees
  parameters."""
  if callable(fragments):
    raise ValueError("a callable fragment rule gives its number of fragments only from the "
                     "parameters: pass it to streaming_diloco, which fixes the schedule at init")
  if isinstance(fragments, (tuple, list)):
    return frag_lib.check_rule_indices(fragments)
  if int(fragments) < 1:
    raise ValueError(f"outer.num_fragments must be >= 1, got {fragments}")
  return 1 if fragments == 1 else int(fragments) + (1 if non_block == "own" else 0)


def diloco(inner: optax.GradientTransformation, outer: optax.GradientTransformation | None = None,
           sync_every: int = 100, axis_name: str = mesh_lib.REPLICA) -> StreamingDiLoCo:
  """DiLoCo (arXiv 2311.08105): Streaming DiLoCo with one fragment, τ = 0, α = 0.

  Every H inner steps: Δ = mean_m(φ − θ_m); φ ← OuterOpt(φ, Δ); θ_m ← φ.

  Example (simulated replicas on one device)::

    tx = lowcomm_jax.diloco(optax.adamw(1e-3), lowcomm_jax.outer_nesterov(0.7, 0.9), sync_every=50)
    params_R, state = tx.init_replicated(params, num_replicas=4)
    def step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    step_R = jax.vmap(step, in_axes=(0, tx.state_axes, 0), out_axes=(0, tx.state_axes),
                      axis_name="replica")
  """
  return streaming_diloco(inner, outer, sync_every, fragments=1, overlap_steps=0, merge_alpha=0.0,
                          axis_name=axis_name)
