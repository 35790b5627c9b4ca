"""What a training loop needs of an outer algorithm over M replicas: one interface, three adapters.

An algorithm here wraps an optax-style transform (`tx`, the object users call) and adds what a loop
must know about it without naming it:

  init_replicated(params, M)       -> (params_R, state): per-replica leaves carry a leading [M] axis
  state_axes                       vmap axes of the state (0: per replica, None: shared)
  phase_at(step)                   the static phase of inner step `step` (1-based), hashable; the
                                   loop compiles one program per phase
  update(grads, state, params, phase) -> (updates, state), for one replica under a bound
                                   `replica` axis
  eval_params(params_R, state)     the model to evaluate (φ for DiLoCo, mean φ_i for NoLoCo)
  eval_replicas                    whether each replica's own model is evaluated too (no global
                                   model)
  refused(state)                   outer steps refused because the global model would hold NaN/inf
  diagnostics(state, phase)        host-side per-step figures (NoLoCo's weight spread on sync steps)
  comm_events(...)                 the run's collectives for the virtual clock
                                   (`sim.clock.CommEvent` fields), derived from the algorithm's
                                   plans and the ledger
  comm_summary(...)                the bytes a worker sends, for summary.json

Every adapter guards the global model: an outer step (data parallel: every step) whose result holds
NaN or inf is refused — the model and its optimizer state are kept — and counted in `refused`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax import comm
from lowcomm_jax.codecs import all_finite
from lowcomm_jax.comm import plan as plan_lib
from lowcomm_jax.optim.noloco import NoLoCo, weight_spread
from lowcomm_jax.optim.streaming import StreamingDiLoCo


class GuardedState(NamedTuple):
  inner_state: Any
  refused: jax.Array  # int32[1]: steps refused because the new parameters held NaN or inf


def guard_finite(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` that refuses a step whose new parameters hold NaN or inf: zero updates, state kept.

  Unlike `optax.apply_if_finite` (which looks at the gradients), this looks at the parameters the
  step would produce, so a finite gradient times a huge learning rate is caught too.
  """

  def init(params):
    return GuardedState(tx.init(params), jnp.zeros((1,), jnp.int32))

  def update(grads, state, params=None):
    updates, inner_state = tx.update(grads, state.inner_state, params)
    ok = all_finite(optax.apply_updates(params, updates))
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
    return updates, GuardedState(keep(inner_state, state.inner_state),
                                 state.refused + jnp.where(ok, 0, 1))

  return optax.GradientTransformation(init, update)


@dataclasses.dataclass
class ReplicatedAlgorithm:
  """The interface, with the defaults of an algorithm that has no phases and no global φ."""

  name: str
  tx: Any
  num_replicas: int
  state_axes: Any = 0
  eval_replicas: bool = False

  def phase_at(self, step: int):
    return None

  def init(self, params):
    """The state of one replica holding `params` (the pipeline keeps one per device)."""
    return self.tx.init(params)

  def init_replicated(self, params, num_replicas: int | None = None):
    params_r = jax.tree.map(lambda x: x[None], params)
    return params_r, jax.vmap(self.tx.init)(params_r)

  def checks_refusals(self, phase) -> bool:
    """Whether the loop reads `refused` after a step of this phase (data parallel: only on logged
    steps, since a host read every step would stall the dispatch of the next)."""
    return False

  def update(self, grads, state, params, phase=None):
    return self.tx.update(grads, state, params)

  def eval_params(self, params_r, state):
    return jax.tree.map(lambda x: x[0], params_r)

  def refused(self, state) -> jax.Array:
    """int32[k]: refused outer steps (per fragment or per replica); summed for the summary."""
    return state.refused

  def refusal_names(self) -> list[str]:
    """What each entry of `refused` counts, for the error message."""
    return ["the parameters"]

  def diagnostics(self, state, phase) -> dict:
    return {}

  def final_diagnostics(self, state) -> dict:
    return {}

  def comm_events(self, num_steps: int, entries_of: Callable, data_workers: int,
                  num_params: int) -> list[tuple]:
    """Data parallel: XLA's gradient all-reduce over the data axis, blocking, every step (its
    overlap with the backward is not modelled)."""
    if data_workers == 1:
      return []
    return [(s, s + 1, 4 * num_params, "all_reduce", data_workers) for s in range(num_steps - 1)]

  def comm_summary(self, steps: int, sent_bytes: float, peak_sync_bytes: float, data_workers: int,
                   num_params: int) -> dict:
    # XLA's own gradient all-reduce over the data axis: a float32 ring every step.
    peak = comm.ring_factor(data_workers) * 4 * num_params
    return _bytes_summary(data_workers, peak * steps, peak, num_params, steps)


def _bytes_summary(workers, total, peak, num_params, steps) -> dict:
  return {"workers": workers, "total": total, "peak_per_sync": peak,
          "bits_per_param_per_step": 8 * total / (num_params * max(steps, 1))}


class DataParallel(ReplicatedAlgorithm):
  """One replica; the inner optimizer is the whole algorithm; XLA all-reduces over `data`."""

  def __init__(self, inner: optax.GradientTransformation, num_replicas: int = 1):
    super().__init__("dp", guard_finite(inner), num_replicas)


class _Phased(ReplicatedAlgorithm):
  """Algorithms whose collectives come from the ledger of the phase's program."""

  def phase_at(self, step: int):
    return self.tx.phase_at(step)

  def init_replicated(self, params, num_replicas: int | None = None):
    return self.tx.init_replicated(params, num_replicas or self.num_replicas)

  def update(self, grads, state, params, phase=None):
    return self.tx.update(grads, state, params, phase=phase)

  def comm_summary(self, steps, sent_bytes, peak_sync_bytes, data_workers, num_params) -> dict:
    return _bytes_summary(self.num_replicas, sent_bytes, peak_sync_bytes, num_params, steps)

  def comm_events(self, num_steps, entries_of, data_workers, num_params):
    """From the plans each phase sends and their ledger entries (`comm.plan.clock_events`)."""
    return plan_lib.clock_events(num_steps, self.phase_at, self.tx.plans, entries_of)


class DiLoCoFamily(_Phased):
  """DiLoCo and Streaming DiLoCo (`optim.streaming_diloco`): fragments of a global φ, all-reduced
  outer gradients; the transform itself refuses a non-finite averaged Δ per fragment."""

  def __init__(self, name: str, tx: StreamingDiLoCo, num_replicas: int, fragment_names=()):
    super().__init__(name, tx, num_replicas, tx.state_axes)
    self.fragment_names = list(fragment_names)

  def eval_params(self, params_r, state):
    # eager: each worker has its own φ; worker 0's is the model evaluated
    return jax.tree.map(lambda x: x[0], state.outer_params) if self.tx.eager else state.outer_params

  def checks_refusals(self, phase) -> bool:
    return bool(phase.receive)

  def refused(self, state):
    return state.nonfinite.sum(0) if self.tx.eager else state.nonfinite

  def refusal_names(self):
    return [f"the averaged outer gradient of fragment {p} ({n})"
            for p, n in enumerate(self.fragment_names)]


class NoLoCoAlgorithm(_Phased):
  """NoLoCo (`optim.noloco`): a φ_i per replica, averaged in random groups by point-to-point
  exchange; no global model, so each replica's own model is evaluated too and the weight spread
  reported."""

  def __init__(self, tx: NoLoCo, num_replicas: int):
    super().__init__("noloco", tx, num_replicas, tx.state_axes, eval_replicas=True)

  def eval_params(self, params_r, state):
    return self.tx.eval_params(state)

  def checks_refusals(self, phase) -> bool:
    return phase.outer

  def refused(self, state):
    return state.refused

  def refusal_names(self):
    return [f"the slow weights of replica {i}" for i in range(self.num_replicas)]

  def diagnostics(self, state, phase) -> dict:
    return {"weight_spread": weight_spread(state.slow)} if phase.outer else {}

  def final_diagnostics(self, state) -> dict:
    return {"final_weight_spread": weight_spread(state.slow)}
