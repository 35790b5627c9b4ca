"""The pieces of asynchronous learners that need no cluster: Delayed Nesterov against a float64
oracle and against DiLoCo's outer step, the staleness rules, HeLoCo's alignment against a float64
oracle (alone and before Delayed Nesterov), the declared speeds and the per-learner H they give."""

from importlib import metadata

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
  assert [staleness.weight("heloco", r) for r in (0, 1, 3)] == [1.0, 0.5, 0.25]
  with pytest.raises(ValueError, match="elastic.staleness must be one of inverse, cutoff, none, "
                     "heloco, got 'stalest'"):
    staleness.weight("stalest", 1)


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


# HeLoCo (optim.alignment): the float64 oracle of one block's alignment, as docs/algorithms.md §1.8
# writes it, and which of its cases the block took
def _align_oracle(d, m, keep=0.2, shrink=1.0, max_shrink=0.5, reorient=0.5, momentum_weight=0.1,
                  eps=1e-8):
  d, m = np.asarray(d, np.float64), np.asarray(m, np.float64)
  nd, nm = np.linalg.norm(d), np.linalg.norm(m)
  if nd == 0 or nm == 0:
    return d, "undefined"
  u, v = d / nd, m / nm
  c = float(np.clip(u.ravel() @ v.ravel(), -1, 1))
  conf = nd / (nd + momentum_weight * nm + eps)
  if c >= keep:
    return d, "kept"
  if c < 0:
    beta = min(shrink * -c * conf, max_shrink)
    return d - beta * c * nd * v, "shrunk (capped)" if beta == max_shrink else "shrunk"
  lam = min(reorient * (1 - c) * conf, 1.0)
  turned = (1 - lam) * u + lam * v
  return nd * turned / max(np.linalg.norm(turned), eps), "turned (capped)" if lam == 1 else "turned"


def _at_cosine(m, cosine, norm, rng):
  """A block of norm `norm` whose cosine with `m` is `cosine` (far from any case's edge)."""
  v = m.ravel() / np.linalg.norm(m)
  w = rng.normal(size=v.shape)
  w -= (w @ v) * v
  w /= np.linalg.norm(w)
  return (norm * (cosine * v + np.sqrt(1 - cosine ** 2) * w)).reshape(m.shape).astype(np.float32)


def _align_bound(block, n):
  """float32 rounding of the alignment, at worst: the norms and the cosine are sums of n products
  (n·eps relative each), conf, β, λ and the turn a few operations more; the result is a sum of u
  and v with coefficients of size ‖Δ_b‖, so its error is within a few n·eps × ‖Δ_b‖ (random
  blocks of 24 values stay under 1% of this)."""
  return 4 * n * np.finfo(np.float32).eps * max(float(np.linalg.norm(block)), 1e-30)


@pytest.mark.parametrize("hyper", [{}, dict(keep=0.5, shrink=3.0, max_shrink=0.9, reorient=4.0,
                                            momentum_weight=1.0)])
def test_heloco_alignment_of_each_block_equals_its_float64_oracle(hyper):
  """Blocks built at a chosen cosine with their momentum, covering every case (kept, anti-aligned
  shrunk with and without the cap β_max, weak turned toward m with and without the cap of λ, m = 0
  and Δ = 0 passed) and each edge between cases (0.02 either side), jitted in float32 against the
  float64 oracle."""
  import jax  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.optim import alignment  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(2)
  m = {k: rng.normal(size=(4, 6)).astype(np.float32) * s
       for k, s in [("kept", 1.0), ("anti", 3.0), ("anti_capped", 0.2), ("weak", 1.0),
                    ("weak_far", 0.3)]}
  d = {"kept": _at_cosine(m["kept"], 0.9, 2.0, rng),
       "anti": _at_cosine(m["anti"], -0.3, 0.5, rng),  # small against m: β under the cap
       "anti_capped": _at_cosine(m["anti_capped"], -0.95, 4.0, rng),
       "weak": _at_cosine(m["weak"], 0.1, 1.5, rng),
       "weak_far": _at_cosine(m["weak_far"], 0.05, 3.0, rng)}
  keep = hyper.get("keep", alignment.DEFAULTS["keep"])
  for name, cosine in [("just_kept", keep + 0.02), ("just_not_kept", keep - 0.02),
                       ("just_weak", 0.02), ("just_anti", -0.02)]:
    m[name] = rng.normal(size=(5, 5))  # the cases' edges, 0.02 off (c is exact to ~1e-6)
    d[name] = _at_cosine(m[name], cosine, 1.0, rng)
  m["no_momentum"], d["no_momentum"] = np.zeros((3, 5), np.float32), rng.normal(size=(3, 5))
  m["no_delta"], d["no_delta"] = rng.normal(size=(7,)), np.zeros((7,), np.float32)
  d = {k: np.asarray(x, np.float32) for k, x in d.items()}
  m = {k: np.asarray(x, np.float32) for k, x in m.items()}
  ours = jax.jit(lambda d, m: alignment.align(d, m, **hyper))(d, m)
  cases = set()
  for k in d:
    expected, case = _align_oracle(d[k], m[k], **hyper)
    cases.add(case)
    assert ours[k].dtype == np.float32 and ours[k].shape == d[k].shape
    np.testing.assert_allclose(ours[k], expected, rtol=0, atol=_align_bound(expected, d[k].size),
                               err_msg=f"{k}: {case}")
    if case in ("kept", "undefined"):  # passed as it is, bit for bit
      np.testing.assert_array_equal(ours[k], d[k])
    if case.startswith("turned"):  # the norm kept
      assert np.linalg.norm(ours[k]) == pytest.approx(np.linalg.norm(d[k]), rel=1e-5)
  assert {"kept", "shrunk", "shrunk (capped)", "undefined"} <= cases
  assert "turned (capped)" in cases if hyper else "turned" in cases


def _delayed_nesterov_oracle(phi, deltas, every, align=None):
  """float64 Delayed Nesterov (N = `every`) on `deltas`, each aligned first by `align(Δ, b)` (the
  momentum b as it is at that merge) when given."""
  p = {k: np.asarray(x, np.float64) for k, x in phi.items()}
  b = {k: np.zeros_like(x) for k, x in p.items()}
  buffer = {k: np.zeros_like(x) for k, x in p.items()}
  for n, delta in enumerate(deltas):
    for k in p:
      d = np.asarray(delta[k], np.float64)
      if align is not None:
        d = align(d, b[k])
      buffer[k] += d
      if n % every == every - 1:
        b[k] = MU * b[k] + buffer[k] / every
        p[k] -= LR * (d / every + MU * b[k])
        buffer[k][:] = 0
      else:
        p[k] -= LR * d / every
  return p


@pytest.mark.parametrize("every", [1, 2])
def test_heloco_before_delayed_nesterov_equals_its_float64_oracle(every):
  """Two outer steps with momentum (N = 1: two merges, Nesterov's optax trace as the momentum;
  N = 2: four merges, Delayed Nesterov's b): the first outer step's merges pass (m = 0), the next
  ones are aligned with the momentum the first left (one leaf anti-aligned, one weak, one kept),
  against the float64 oracle of the alignment and Delayed Nesterov."""
  import jax  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.optim import alignment  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  phi = {k: rng.normal(size=(3, 4)).astype(np.float32) for k in ("anti", "weak", "kept")}
  first = [{k: rng.normal(size=(3, 4)).astype(np.float32) for k in phi} for _ in range(every)]
  # the momentum after the first outer step: the mean of its merges (b = 0 + mean)
  b = {k: np.mean([d[k] for d in first], axis=0) for k in phi}
  second = [{"anti": _at_cosine(b["anti"], -0.5, 1.0, rng),
             "weak": _at_cosine(b["weak"], 0.1, 1.0, rng),
             "kept": _at_cosine(b["kept"], 0.6, 1.0, rng)} for _ in range(every)]
  if every == 2:  # the second merge of the buffer sees the same b (Delayed Nesterov moves it later)
    second[1] = {k: _at_cosine(b[k], c, 2.0, rng) for k, c in zip(phi, (-0.8, 0.15, 0.9))}
  tx = alignment.heloco(optim.delayed_nesterov(LR, MU, every))
  state, ours = tx.init(phi), phi
  step = jax.jit(tx.update)
  for delta in first + second:
    updates, state = step(delta, state)
    ours = optax.apply_updates(ours, updates)
  expected = _delayed_nesterov_oracle(phi, first + second, every,
                                      lambda d, b: _align_oracle(d, b)[0])
  plain = _delayed_nesterov_oracle(phi, first + second, every)
  for k in phi:
    scale = max(float(np.abs(expected[k]).max()), 1.0)
    # 2N merges, each an alignment of a block of 12 (`_align_bound`) and a few operations more
    bound = 2 * every * (4 * 12 + 8) * np.finfo(np.float32).eps * scale
    np.testing.assert_allclose(ours[k], expected[k], rtol=0, atol=bound, err_msg=k)
    if k != "kept":  # not vacuous: the alignment moved φ (the kept leaf is plain Delayed Nesterov)
      assert float(np.abs(plain[k] - expected[k]).max()) > 100 * bound, k
  assert float(np.abs(plain["kept"] - expected["kept"]).max()) < 1e-12


# XLA's CPU compiler as a run has it, not as conftest.py sets it for the suite's speed: LLVM's
# optimizations on (they contract a multiply and an add into one FMA where the fusion allows it)
# and, where the flag exists (jaxlib 0.10), the fusion emitters
_PRODUCTION_CPU = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False,
                   **({"xla_cpu_use_fusion_emitters": True}
                      if metadata.version("jaxlib").startswith("0.10.") else {})}


def test_heloco_with_every_delta_aligned_is_delayed_nesterov_bit_for_bit():
  """Eight merges (N = 2) of outer gradients close to one direction: every block's cosine with the
  momentum, once there is one, is above c_ok, so φ and the state equal plain Delayed Nesterov's bit
  for bit, each merge one program (the update and φ's step, as the syncer runs them) compiled as in
  a run, on blocks large enough for vectorized code (where the outer optimizer's multiply-adds fused
  with the correction would round otherwise)."""
  import jax  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.optim import alignment  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(4)
  phi = {"w": rng.normal(size=(64, 33)).astype(np.float32), "b": rng.normal(size=(33,))}
  phi = {k: np.asarray(x, np.float32) for k, x in phi.items()}
  direction = {k: rng.normal(size=x.shape) for k, x in phi.items()}
  deltas = [{k: (x + 0.3 * rng.normal(size=x.shape)).astype(np.float32)
             for k, x in direction.items()} for _ in range(8)]
  results, plain_tx = [], optim.delayed_nesterov(LR, MU, 2)
  for tx in (alignment.heloco(plain_tx), plain_tx):

    def merge(p, state, delta, tx=tx):
      updates, state = tx.update(delta, state)
      return optax.apply_updates(p, updates), state

    state, p, cosines = tx.init(phi), phi, []
    step = jax.jit(merge).lower(p, state, deltas[0]).compile(compiler_options=_PRODUCTION_CPU)
    for delta in deltas:
      for k in phi:
        b = np.asarray(state.momentum[k], np.float64).ravel()
        if b.any():
          d = np.asarray(delta[k], np.float64).ravel()
          cosines.append(d @ b / np.linalg.norm(d) / np.linalg.norm(b))
      p, state = step(p, state, delta)
    results.append((p, state, cosines))
  (ours, our_state, cosines), (plain, plain_state, _) = results
  assert len(cosines) == 2 * 6 and min(cosines) >= alignment.DEFAULTS["keep"]  # the premise
  for a, b in zip(jax.tree.leaves((ours, our_state)), jax.tree.leaves((plain, plain_state)),
                  strict=True):
    np.testing.assert_array_equal(a, b)


def test_heloco_refuses_bad_arguments_in_one_line():
  from lowcomm_jax.optim import alignment  # pylint: disable=g-import-not-at-top
  outer = optim.delayed_nesterov(LR, MU, 2)
  for args, message in [({"keep": 1.5}, "keep must be a number in [-1, 1], got 1.5"),
                        ({"shrink": -1.0}, "shrink must be a finite number >= 0, got -1.0"),
                        ({"max_shrink": 2.0}, "max_shrink must be a number in [0, 1], got 2.0"),
                        ({"reorient": float("nan")}, "reorient must be a finite number >= 0"),
                        ({"momentum_weight": -0.1}, "momentum_weight must be a finite number"),
                        ({"eps": 0.0}, "eps must be a finite number > 0, got 0.0")]:
    with pytest.raises(ValueError) as error:
      alignment.heloco(outer, **args)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
  params = {"w": np.zeros(3, np.float32)}
  for no_momentum in (optax.sgd(0.7), optax.adam(0.1)):
    with pytest.raises(ValueError, match="^heloco's outer optimizer must hold one momentum buffer"):
      alignment.heloco(no_momentum).init(params)
