"""The pieces of asynchronous learners that need no cluster: Delayed Nesterov against a float64
oracle and against DiLoCo's outer step, the staleness rules, the declared speeds and the
per-learner H they give."""

import numpy as np
import optax
import pytest

from lowcomm_jax import config as config_lib, optim
from lowcomm_jax.elastic import options
from lowcomm_jax.optim import staleness
from lowcomm_jax.train import faults

LR, MU = 0.7, 0.9


def _apply(tx, phi, deltas):
  state = tx.init(phi)
  for d in deltas:
    updates, state = tx.update(d, state)
    phi = optax.apply_updates(phi, updates)
  return phi


def test_delayed_nesterov_equals_its_float64_oracle():
  """N = 3, seven outer gradients: plain steps of Δ/N, the momentum moving on every third, the
  buffer emptied; within float32 rounding of a few operations per step on values of size ~1."""
  rng = np.random.default_rng(0)
  phi = {"w": rng.normal(size=(5, 3)).astype(np.float32)}
  deltas = [{"w": rng.normal(size=(5, 3)).astype(np.float32)} for _ in range(7)]
  ours = _apply(optim.delayed_nesterov(LR, MU, 3), phi, deltas)
  p, b, buffer = phi["w"].astype(np.float64), np.zeros((5, 3)), np.zeros((5, 3))
  for k, d in enumerate(deltas):
    d = d["w"].astype(np.float64)
    buffer += d
    if k % 3 == 2:
      b = MU * b + buffer / 3
      p -= LR * (d / 3 + MU * b)
      buffer[:] = 0
    else:
      p -= LR * d / 3
  scale = max(np.abs(p).max(), 1.0)
  np.testing.assert_allclose(ours["w"], p, rtol=0, atol=7 * 8 * np.finfo(np.float32).eps * scale)


def test_n_outer_gradients_from_one_phi_give_diloco_outer_step_on_their_mean():
  """Two buffers of N = 4 outer gradients each, every one from the same φ as its buffer's others:
  φ after each buffer equals DiLoCo's Nesterov step on the buffer's mean (the steps of Δ/N add up
  to the mean; the momentum sees the mean), within float32 rounding of N additions."""
  rng = np.random.default_rng(1)
  phi = {"w": rng.normal(size=(64,)).astype(np.float32)}
  rounds = [[{"w": rng.normal(size=(64,)).astype(np.float32)} for _ in range(4)] for _ in range(2)]
  delayed = _apply(optim.delayed_nesterov(LR, MU, 4), phi, [d for r in rounds for d in r])
  means = [{"w": np.mean([d["w"] for d in r], axis=0)} for r in rounds]
  synchronous = _apply(optim.outer_nesterov(LR, MU), phi, means)
  bound = 2 * 4 * 8 * np.finfo(np.float32).eps * float(np.abs(synchronous["w"]).max())
  assert float(np.abs(delayed["w"] - synchronous["w"]).max()) <= bound
  # not vacuous: without the delay (momentum on every Δ) φ is elsewhere
  every = _apply(optim.outer_nesterov(LR, MU), phi,
                 [{"w": d["w"] / 4} for r in rounds for d in r])
  assert float(np.abs(every["w"] - synchronous["w"]).max()) > 1e3 * bound


def test_staleness_rules():
  # 4 learners in turn: up to 3 merges stale is no round behind; 4 to 7 is one
  assert [staleness.rounds_behind(s, 4) for s in (0, 3, 4, 7, 8)] == [0, 0, 1, 1, 2]
  assert [staleness.weight("inverse", r) for r in (0, 1, 3)] == [1.0, 0.5, 0.25]
  assert [staleness.weight("cutoff", r, 2) for r in (0, 2, 3)] == [1.0, 1.0, 0.0]
  assert [staleness.weight("none", r) for r in (0, 9)] == [1.0, 1.0]
  with pytest.raises(ValueError, match="elastic.staleness must be one of inverse, cutoff, none"):
    staleness.weight("heloco", 1)


def test_declared_speeds_and_the_local_steps_they_give():
  assert faults.speeds("", 3) == (1.0, 1.0, 1.0)
  assert faults.slowdowns("1, 1, 0.5, 0.25", 4) == (1.0, 1.0, 2.0, 4.0)
  for bad in ("1,0", "1,-2", "1", "1,fast", "1,nan"):
    with pytest.raises(ValueError, match=r"^elastic.speeds must be 2 numbers > 0"):
      faults.speeds(bad, 2)
  c = config_lib.override(config_lib.default_config(), {
      "num_steps": 300, "outer.sync_every": 30, "elastic.num_learners": 4,
      "elastic.speeds": "1,1,0.5,0.25", "elastic.asynchronous": True})
  assert [options.local_steps(c, i) for i in range(4)] == [(30, 300)] * 4  # local_steps=equal
  config_lib.override(c, {"elastic.local_steps": "by_speed"})
  # H_i ∝ speed: every learner's 10 phases take about the same wall time
  assert [options.local_steps(c, i) for i in range(4)] == [(30, 300), (30, 300), (15, 150),
                                                           (8, 80)]
  learner = options.learner_config(c, 3)
  assert (learner.outer.sync_every, learner.num_steps, learner.num_replicas) == (8, 80, 1)


def test_an_eager_learner_goes_on_from_the_syncers_phi_with_nothing_of_its_own_in_flight():
  """`learner.eager_state`: a (re)joining eager learner (τ = 2H: two lanes) takes φ and the outer
  state of the syncer's algorithm (DiLoCo's, τ = 0) as its own φ_m, keeps its inner state, and
  holds no kept Δ and no in-flight mean (its next proxy takes no old share out)."""
  import jax  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.comm import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.elastic import learner  # pylint: disable=g-import-not-at-top
  params = {"w": np.arange(4, dtype=np.float32), "b": np.ones(2, np.float32)}
  eager = optim.streaming_diloco(optax.adam(0.1), sync_every=3, overlap_steps=6, eager=True)
  _, own = eager.init_replicated(params, 1)
  own = jax.tree.map(lambda x: np.asarray(x) + 1.0, jax.device_get(own))  # a learner mid-run
  syncer = optim.streaming_diloco(optax.adam(0.1), sync_every=3)
  phi = jax.tree.map(lambda x: 2.0 * x, params)
  shared = plan_lib.shared_part(syncer.state_axes, syncer.init(phi))
  state = learner.eager_state(own, shared)
  assert jax.tree.structure(state) == jax.tree.structure(own)
  for a, b in zip(jax.tree.leaves(state.outer_params), jax.tree.leaves(phi), strict=True):
    np.testing.assert_array_equal(a, np.asarray(b)[None])
  assert all(not np.any(x) for x in jax.tree.leaves((state.own_deltas, state.comm.in_flight)))
  assert sorted(state.comm.in_flight) == ["fragment 0", "fragment 0, lane 1"]
  for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(own.inner_state)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(state.outer_states),
                  jax.tree.leaves(jax.tree.map(lambda x: np.asarray(x)[None],
                                               shared.outer_states))):
    np.testing.assert_array_equal(a, b)
