"""NoLoCo (arXiv 2506.10911): outer steps by gossip in small random groups, with no all-reduce.

Each replica i keeps fast weights θ_i, slow weights φ_i and an outer momentum δ_i. Every H inner
steps the replicas are split into random groups of n (pairs by default); the split is drawn from a
seed that every replica shares, so all agree without talking. Inside a group the peers exchange φ_j
and Δ_j = φ_j − θ_j with static permutations (`lax.ppermute`), and each replica applies
(docs/algorithms.md §2.3, heavy-ball form):

  δ_i ← α·δ_i − β·mean_G(Δ) − γ·(φ_i − mean_G(φ));   φ_i ← φ_i + δ_i;   θ_i ← φ_i

α is the outer momentum, β the outer learning rate and γ pulls φ_i toward its group's mean. With one
group of all M replicas and γ = 0 this is DiLoCo with heavy-ball outer momentum.

Groupings come from a pool of `num_groupings` random partitions drawn from the seed; outer step k
uses pool entry hash(seed, k) (`grouping_index`), so groupings vary from step to step and are
reproducible. A run compiles two programs whatever its length and pool size: the inner step, and
the outer step, which picks its grouping's exchange with `lax.switch` on an index computed from the
step count (not mapped over replicas), so only the taken grouping's permutations run.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowcomm_jax import checks, comm, mesh as mesh_lib
from lowcomm_jax.codecs import all_finite
from lowcomm_jax.comm import dispatch
from lowcomm_jax.optim.outer import check_transformation


class NoLoCoState(NamedTuple):
  count: jax.Array  # int32[]: inner steps taken (same on every replica)
  inner_state: Any  # per replica
  slow: Any  # φ_i, float32, per replica
  momentum: Any  # δ_i, float32, per replica
  refused: jax.Array  # int32[]: outer steps this replica refused because φ_i would hold NaN or inf
  comm: comm.CommState  # nothing kept between steps: both group means are consumed at once


SLOW, DELTA = "noloco slow weights", "noloco outer gradient"  # the plans' names


class NoLoCoPhase(NamedTuple):
  """A step's program: `outer` when an outer step follows the inner one (its grouping is read
  from the step count inside the program)."""

  outer: bool = False


def groupings(num_replicas: int, group_size: int, num_groupings: int, seed: int) -> np.ndarray:
  """The pool: int[num_groupings, M // n, n], each entry a partition of the replicas into groups."""
  rng = np.random.default_rng(seed)
  return np.stack(
    [rng.permutation(num_replicas).reshape(-1, group_size) for _ in range(num_groupings)]
  )


class NoLoCo:
  """init/update like an optax transformation under a bound replica axis, plus its phases."""

  def __init__(self, inner, num_replicas: int, sync_every: int, group_size: int = 2,
               momentum: float = 0.5, learning_rate: float = 0.7, gamma: float = 0.7, seed: int = 0,
               num_groupings: int = 16, axis_name: str = mesh_lib.REPLICA, codec=None):
    check_transformation(inner, "inner optimizer")
    sync_every = checks.sync_every(sync_every, "noloco.sync_every")
    if group_size < 2 or num_replicas % group_size:
      raise ValueError(f"noloco.group_size must be >= 2 and divide num_replicas={num_replicas}, "
                       f"got {group_size}")
    if num_groupings < 1:
      raise ValueError(f"noloco.num_groupings must be >= 1, got {num_groupings}")
    self.inner, self.num_replicas = optax.with_extra_args_support(inner), num_replicas
    self.sync_every = sync_every
    self.group_size, self.momentum, self.learning_rate, self.gamma = (
      group_size,
      momentum,
      learning_rate,
      gamma,
    )
    self.seed, self.axis_name, self.codec = seed, axis_name, codec
    self.pool = groupings(num_replicas, group_size, num_groupings, seed)
    self.state_axes = NoLoCoState(count=None, inner_state=0, slow=0, momentum=0, refused=0,
                                  comm=comm.COMM_STATE_AXES)
    self.phases = (NoLoCoPhase(False), NoLoCoPhase(True))
    self._plans = {SLOW: comm.Plan("group_mean", groupings=self.pool),
                   DELTA: comm.Plan("group_mean", codec, groupings=self.pool)}

  def grouping_index(self, outer_step):
    """Pool index of outer step k (0-based): a multiplicative hash of (seed, k) modulo the pool
    size.

    The same on every replica and for every run with this seed; it varies with k. Works on Python
    ints (the host's phase) and on uint32 arrays (the traced `update`) with identical results.
    """
    if isinstance(outer_step, int):
      return ((outer_step * 2654435761 + self.seed * 40503 + 12345) % 2**32 >> 7) % len(self.pool)
    k = outer_step.astype(jnp.uint32)
    mixed = k * jnp.uint32(2654435761) + jnp.uint32((self.seed * 40503 + 12345) % 2**32)
    return ((mixed >> 7) % len(self.pool)).astype(jnp.int32)

  def phase_at(self, step: int) -> NoLoCoPhase:
    return NoLoCoPhase(outer=step % self.sync_every == 0)

  def groups_at(self, step: int) -> np.ndarray | None:
    """The groups of the outer step taken after inner step `step` (1-based), or None."""
    if step % self.sync_every:
      return None
    return self.pool[self.grouping_index(step // self.sync_every - 1)]

  def init(self, params) -> NoLoCoState:
    slow = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    return NoLoCoState(jnp.zeros((), jnp.int32), self.inner.init(params), slow,
                       jax.tree.map(jnp.zeros_like, slow), jnp.zeros((), jnp.int32),
                       comm.CommState({}, {}))

  def init_replicated(self, params, num_replicas: int):
    if num_replicas != self.num_replicas:
      raise ValueError(f"num_replicas={num_replicas} but NoLoCo was built for {self.num_replicas}")
    state = self.init(params)
    stack = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (num_replicas,) + x.shape), t)
    return stack(params), state._replace(inner_state=stack(state.inner_state),
                                         slow=stack(state.slow),
                                         momentum=stack(state.momentum),
                                         refused=stack(state.refused))

  def eval_params(self, state: NoLoCoState):
    """The replicas' mean slow weights (there is no global model; each replica has its own φ_i)."""
    return jax.tree.map(lambda x: x.mean(0), state.slow)

  def update(self, grads, state: NoLoCoState, params, phase=None, **extra_args):
    """`extra_args` go to the inner optimizer (e.g. `value=` for `optax.polyak_sgd`)."""
    if phase is not None:
      return self._apply(NoLoCoPhase(*phase).outer, grads, state, params, **extra_args)
    # The step count is the same on every replica (not mapped), so this stays a conditional.
    outer = (state.count + 1) % self.sync_every == 0
    branches = [functools.partial(self._apply, o, **extra_args) for o in (False, True)]
    return jax.lax.switch(outer.astype(jnp.int32), branches, grads, state, params)

  # -- the outer step as plans (`comm.plan.OuterStep`) -------------------------------------------
  def plans(self, phase) -> dict:
    """The outer phase sends φ_i and Δ_i = φ_i − θ_i, each averaged within the step's groups."""
    return dict(self._plans) if NoLoCoPhase(*phase).outer else {}

  def consumes(self, phase) -> tuple:
    return tuple(self.plans(phase))

  def without_delayed(self, phase) -> NoLoCoPhase:
    return phase  # nothing is delayed

  def local(self, state: NoLoCoState, params, phase) -> dict:
    if not NoLoCoPhase(*phase).outer:
      return {}
    return {SLOW: state.slow,
            DELTA: jax.tree.map(lambda s, l: s - l.astype(jnp.float32), state.slow, params)}

  def apply(self, state: NoLoCoState, params, incoming: dict, phase=None):
    """δ_i ← α·δ_i − β·mean_G(Δ) − γ·(φ_i − mean_G(φ)); φ_i ← φ_i + δ_i; θ_i ← φ_i."""
    del phase
    slow = state.slow
    momentum = jax.tree.map(
        lambda d, gd, s, gs: self.momentum * d - self.learning_rate * gd - self.gamma * (s - gs),
        state.momentum, incoming[DELTA], slow, incoming[SLOW])
    new_slow = jax.tree.map(jnp.add, slow, momentum)
    # A NaN or inf never reaches φ_i: this replica refuses the outer step (φ_i and δ_i kept),
    # restarts θ_i from φ_i and counts it; the loop raises or logs it (config `nonfinite`).
    finite = all_finite(new_slow)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    slow, momentum = keep(new_slow, slow), keep(momentum, state.momentum)
    refused = state.refused + jnp.where(finite, 0, 1)
    params = jax.tree.map(lambda s, l: s.astype(l.dtype), slow, params)
    return params, state._replace(slow=slow, momentum=momentum, refused=refused)

  def _apply(self, outer: bool, grads, state: NoLoCoState, params, **extra_args):
    inner_updates, inner_state = self.inner.update(grads, state.inner_state, params, **extra_args)
    local = optax.apply_updates(params, inner_updates)
    phase = NoLoCoPhase(outer)
    if outer:
      outer_step = jnp.maximum((state.count + 1) // self.sync_every - 1, 0)
      carried, state = dispatch.carry_phase(self, state, local, phase, self.axis_name,
                                            delayed=False, grouping=self.grouping_index(outer_step))
      local, state = self.apply(state, local, carried, phase)
    new_state = state._replace(count=state.count + 1, inner_state=inner_state)
    return jax.tree.map(lambda n, o: n - o, local, params), new_state


@jax.jit
def weight_spread(params_r) -> jax.Array:
  """NoLoCo's diagnostic: RMS distance of the replicas' weights [M, ...] from their mean, per
  parameter, sqrt(Σ_i ‖φ_i − φ̄‖² / (M · N)). Outside the step: its mean is an all-reduce."""
  leaves = jax.tree.leaves(params_r)
  squares = sum(jnp.sum((x - x.mean(0)) ** 2) for x in leaves)
  return jnp.sqrt(squares / sum(x.size for x in leaves))


def noloco(inner: optax.GradientTransformation, num_replicas: int, sync_every: int = 50,
           group_size: int = 2, momentum: float = 0.5, learning_rate: float = 0.7,
           gamma: float = 0.7,
           seed: int = 0, num_groupings: int = 16, axis_name: str = mesh_lib.REPLICA,
           codec=None) -> NoLoCo:
  """NoLoCo's optimizer (defaults from the reference code: α 0.5, β = γ = 0.7, n = 2, H = 50).

  `codec` (a `lowcomm_jax.codecs.Codec`, e.g. `get_codec("e3m0")`) encodes the outer gradients Δ on
  the wire; slow weights φ always travel in float32 (quantizing them would move the model itself).
  """
  return NoLoCo(inner, num_replicas, sync_every, group_size, momentum, learning_rate, gamma, seed,
                num_groupings, axis_name, codec)
