"""Eager outer updates (docs/algorithms.md §1.7) against DiLoCo and a float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowcomm_jax
from lowcomm_jax import testing
from lowcomm_jax.optim import schedule as schedule_lib
from lowcomm_jax.train import Trainer, hooks

H, M = 3, 3
GAMMA, ETA, MU = 0.1, 0.7, 0.9  # inner SGD lr; outer Nesterov lr and momentum

def _quadratic(steps, replicas, dim=5, seed=0):
  """f_m(w) = ½‖w − c‖², c drawn per step and replica: Δ has a closed form per inner step."""
  rng = np.random.default_rng(seed)
  w0 = rng.normal(size=dim).astype(np.float32)
  targets = rng.normal(size=(steps, replicas, dim)).astype(np.float32)
  loss_fn = lambda p, c: 0.5 * jnp.sum((p["w"] - c) ** 2)
  return {"w": jnp.asarray(w0)}, jnp.asarray(targets), loss_fn

def _eager(sync_every=H, naive_delay=False, lanes=1):
  return lowcomm_jax.streaming_diloco(optax.sgd(GAMMA), lowcomm_jax.outer_nesterov(ETA, MU),
                                      sync_every=sync_every, overlap_steps=lanes * sync_every,
                                      eager=not naive_delay, naive_delay=naive_delay)

def _oracle(w0, targets, outer_steps, naive=False, lanes=1):
  """The paper's eager DiLoCo in float64, D = `lanes` outer steps late: per worker m at outer step
  t, with Δ̄⁽ᵏ⁾ = Δ_m⁽ᵏ⁾ = 0 for k ≤ 0, Δ̃_m⁽ᵗ⁾ = Δ̄⁽ᵗ⁻ᴰ⁾ − Δ_m⁽ᵗ⁻ᴰ⁾/M + Δ_m⁽ᵗ⁾/M, then Nesterov on
  worker m's own φ_m. `naive`: the naive delay, Δ̃_m⁽ᵗ⁾ = Δ̄⁽ᵗ⁻ᴰ⁾."""
  replicas = targets.shape[1]
  phi = np.tile(np.asarray(w0, np.float64), (replicas, 1))
  momentum = np.zeros_like(phi)
  own = [np.zeros_like(phi)] * lanes  # own[k % D]: worker m's Δ of outer step k, k > t − D
  landed = [np.zeros(phi.shape[1])] * lanes  # the means in flight, by the same index
  targets = np.asarray(targets, np.float64)
  for t in range(outer_steps):
    theta = phi.copy()
    for s in range(t * H, (t + 1) * H):
      theta -= GAMMA * (theta - targets[s])
    fresh, lane = phi - theta, t % lanes
    proxy = np.broadcast_to(landed[lane], phi.shape) if naive else \
        landed[lane] - own[lane] / replicas + fresh / replicas
    momentum = MU * momentum + proxy
    phi = phi - ETA * (proxy + MU * momentum)
    # the mean sent now lands D outer steps later
    own, landed = list(own), list(landed)
    own[lane], landed[lane] = fresh, fresh.mean(0)
  return phi

def test_first_two_outer_steps_match_the_float64_oracle():
  params, targets, loss_fn = _quadratic(2 * H, M)
  params_r, state = testing.run_replicas(_eager(), params, targets, loss_fn, use_phase=True)
  want = _oracle(params["w"], targets, outer_steps=2)
  # float32 against float64: per outer step H inner steps of 3 roundings and ≤ 12 roundings of
  # the proxy and Nesterov, each of a value ≤ scale, amplified at most (1 + η(1 + μ)) per step.
  scale = max(np.abs(want).max(), np.abs(np.asarray(targets)).max(), 1.0)
  bound = 2 * (3 * H + 12) * (1 + ETA * (1 + MU)) ** 2 * np.finfo(np.float32).eps * scale
  np.testing.assert_allclose(np.asarray(state.outer_params["w"]), want, rtol=0, atol=bound)
  # θ_m restarts from φ_m (the update θ + (φ − θ) rounds once more)
  np.testing.assert_allclose(np.asarray(params_r["w"]), want, rtol=0, atol=bound)
  # the workers differ: each took its own fresh Δ (a naive delay would give them one φ)
  assert np.abs(want[0] - want[1]).max() > 100 * bound

def test_two_outer_steps_late_match_the_float64_oracle():
  """Eager with τ = 2H: two means of the fragment in flight at once (lanes 0 and 1), each landing
  two sync steps after it was sent; four outer steps against the oracle with D = 2, and far from
  D = 1's (the lanes are not one buffer)."""
  params, targets, loss_fn = _quadratic(4 * H, M)
  tx = _eager(lanes=2)
  _, state = testing.run_replicas(tx, params, targets, loss_fn, use_phase=True)
  want = _oracle(params["w"], targets, outer_steps=4, lanes=2)
  scale = max(np.abs(want).max(), np.abs(np.asarray(targets)).max(), 1.0)
  bound = 4 * (3 * H + 12) * (1 + ETA * (1 + MU)) ** 4 * np.finfo(np.float32).eps * scale
  np.testing.assert_allclose(np.asarray(state.outer_params["w"]), want, rtol=0, atol=bound)
  one_late = _oracle(params["w"], targets, outer_steps=4)
  assert np.abs(one_late - want).max() > 100 * bound
  # the same with the step count picking the phase in the program (`lax.switch` over a 2H cycle)
  _, switched = testing.run_replicas(tx, params, targets, loss_fn, use_phase=False)
  np.testing.assert_allclose(np.asarray(switched.outer_params["w"]), want, rtol=0, atol=bound)
  assert sorted(state.comm.in_flight) == ["fragment 0", "fragment 0, lane 1"]

def test_the_naive_delay_applies_the_previous_outer_steps_mean_as_it_is():
  """outer.naive_delay (the paper's baseline): the first outer step applies nothing (Δ̄⁽⁰⁾ = 0),
  the second the first's mean; every worker then holds the same φ. Three outer steps against the
  oracle, within the eager test's bound per step."""
  params, targets, loss_fn = _quadratic(3 * H, M)
  _, state = testing.run_replicas(_eager(naive_delay=True), params, targets, loss_fn,
                                  use_phase=True)
  want = _oracle(params["w"], targets, outer_steps=3, naive=True)
  scale = max(np.abs(want).max(), np.abs(np.asarray(targets)).max(), 1.0)
  bound = 3 * (3 * H + 12) * (1 + ETA * (1 + MU)) ** 3 * np.finfo(np.float32).eps * scale
  np.testing.assert_allclose(np.asarray(state.outer_params["w"]), want, rtol=0, atol=bound)
  assert np.abs(want[0] - want[1]).max() == 0  # one φ for all
  eager = _oracle(params["w"], targets, outer_steps=3)
  assert np.abs(eager - want).max() > 100 * bound  # not the eager step

def test_one_worker_equals_diloco():
  """With M = 1 the landed mean is the worker's own previous Δ, taken out exactly (a − 1·a = 0)
  and replaced by the fresh Δ: the proxy is DiLoCo's Δ, and the run DiLoCo's up to how XLA fuses
  the two programs' elementwise arithmetic (bit for bit where it fuses them alike): within the
  oracle test's bound per outer step, four outer steps."""
  params, targets, loss_fn = _quadratic(4 * H, 1)
  eager_r, eager_state = testing.run_replicas(_eager(), params, targets, loss_fn, use_phase=True)
  diloco = lowcomm_jax.diloco(optax.sgd(GAMMA), lowcomm_jax.outer_nesterov(ETA, MU), sync_every=H)
  want_r, want_state = testing.run_replicas(diloco, params, targets, loss_fn, use_phase=True)
  want = np.asarray(want_state.outer_params["w"])
  scale = max(np.abs(want).max(), np.abs(np.asarray(targets)).max(), 1.0)
  bound = 4 * (3 * H + 12) * (1 + ETA * (1 + MU)) ** 4 * np.finfo(np.float32).eps * scale
  np.testing.assert_allclose(np.asarray(eager_r["w"]), np.asarray(want_r["w"]), rtol=0, atol=bound)
  np.testing.assert_allclose(np.asarray(eager_state.outer_params["w"][0]), want, rtol=0,
                             atol=bound)
  # not vacuous: φ moved by more than the bound in four outer steps
  assert np.abs(want - np.asarray(params["w"])).max() > 1e3 * bound

def test_streaming_fragments_run_the_same_eager_step():
  """Streaming DiLoCo, two unstaggered fragments: each fragment's proxy and Nesterov step are
  elementwise, so the run equals eager DiLoCo's to the rounding of programs compiled apart."""
  params, targets, loss_fn = _quadratic(3 * H, M, dim=4)
  params = {"a": params["w"][:2], "b": params["w"][2:]}
  split = lambda p, c: loss_fn({"w": jnp.concatenate([p["a"], p["b"]])}, c)
  inner, outer = optax.sgd(GAMMA), lowcomm_jax.outer_nesterov(ETA, MU)
  one = lowcomm_jax.streaming_diloco(inner, outer, sync_every=H, overlap_steps=H, eager=True)
  two = lowcomm_jax.streaming_diloco(inner, outer, sync_every=H, fragments=[("a", 0), ("b", 1)],
                                     overlap_steps=H, staggered=False, eager=True)
  a, sa = testing.run_replicas(one, params, targets, split, use_phase=True)
  b, sb = testing.run_replicas(two, params, targets, split, use_phase=True)
  # 3 outer steps of ≤ 3H + 12 roundings each (as the oracle test's bound)
  testing.assert_trees_within((b, sb.outer_params), (a, sa.outer_params),
                              testing.trajectory_error_bound((a, sa.outer_params), 3, 3 * H + 12))
  phi_a = np.asarray(sa.outer_params["a"])
  assert not np.array_equal(phi_a[0], phi_a[1])  # the workers' φ_m differ


def test_every_sync_step_runs_the_outer_step_and_the_send_follows_it():
  schedule = schedule_lib.make_schedule(1, H, overlap_steps=H, eager=True)
  phases = [schedule_lib.phase_at(schedule, s) for s in range(1, 3 * H + 2)]
  assert [s for s, ph in enumerate(phases, 1) if ph.receive] == [H, 2 * H, 3 * H]
  assert [s for s, ph in enumerate(phases, 1) if ph.send] == [H + 1, 2 * H + 1, 3 * H + 1]


def test_two_lanes_alternate_and_each_lands_two_sync_steps_later():
  """τ = 2H, two staggered fragments (H = 4, offsets 2 and 4): slot q = p + 2j is fragment p's lane
  j; lane j receives at p's sync steps k with k % 2 = j and sends right after them."""
  schedule = schedule_lib.make_schedule(2, 4, overlap_steps=8, eager=True)
  assert (schedule.lanes, schedule.num_slots, schedule.cycle) == (2, 4, 8)
  phases = {s: schedule_lib.phase_at(schedule, s) for s in range(1, 20)}
  received = {q: [s for s, ph in phases.items() if q in ph.receive and s < 19] for q in range(4)}
  sent = {q: [s for s, ph in phases.items() if q in ph.send] for q in range(4)}
  assert received == {0: [2, 10, 18], 1: [4, 12], 2: [6, 14], 3: [8, 16]}
  assert sent == {q: [s + 1 for s in steps] for q, steps in received.items()}
  _, table, s0 = schedule_lib.phase_table(schedule)
  assert len(table) == s0 + 8 - 1  # one cycle of 2H after the start

@pytest.mark.parametrize("kwargs, message", [
    (dict(overlap_steps=1), "outer.eager needs outer.overlap_steps (τ) = outer.sync_every"),
    (dict(overlap_steps=3 * H), "outer.eager needs outer.overlap_steps (τ) = outer.sync_every"),
    (dict(overlap_steps=H + 1), "outer.eager needs outer.overlap_steps (τ) = outer.sync_every"),
    (dict(overlap_steps=H, overlap_anchor="apply"), "outer.eager needs outer.overlap_anchor"),
])
def test_bad_schedules_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    schedule_lib.make_schedule(1, H, eager=True, **kwargs)


# The Trainer on the tiny model: eager DiLoCo, M = 2, H = τ = 3, 8 steps (outer steps after 3 and
# 6, the first mean landing at 6; sends issued with steps 4 and 7).
TRAINER_CASE = {"algorithm": "diloco", "num_replicas": 2, "num_steps": 8, "outer.sync_every": 3,
                "outer.overlap_steps": 3, "outer.eager": True, "data.seq_len": 32,
                "data.batch_size": 4, "eval.batch_size": 4, "eval.num_batches": 1, "log_every": 4,
                "optimizer.warmup_steps": 2, "mesh.replica": 1, "mesh.data": 1}


def _train(tmp_path, name, **changes):
  """(Trainer, summary, final state, the thread's transfers) of a run of TRAINER_CASE."""
  trainer = Trainer(testing.tiny_config(**{**TRAINER_CASE, **changes}), tmp_path / name)
  final, timeline = hooks.FinalState(), hooks.CommTimeline()
  summary = trainer.run(hooks=[final, timeline])
  return trainer, summary, final.state, timeline.issued


def test_thread_equals_inline_sends_the_overlapped_bytes_and_resumes(tmp_path):
  inline, inline_summary, inline_state, _ = _train(tmp_path, "inline",
                                                   **{"outer.overlap_executor": "inline"})
  threaded, _, threaded_state, issued = _train(tmp_path, "thread",
                                               **{"outer.overlap_executor": "thread"})
  assert (inline.overlap_executor, threaded.overlap_executor) == ("inline", "thread")
  assert [i.step for i in issued] == [4, 7]
  # The thread's apply is a program of its own (inline it is fused into the step): per step the
  # mean over M = 2, the proxy's 3 ops, the outer step's and θ + (φ − θ) ≤ 4 may round apart.
  diff = testing.max_abs_diff(inline_state, threaded_state)
  print(f"thread − inline: max abs diff {diff:.3g}")
  testing.assert_states_within(threaded_state, inline_state, 8, 2 + 3 + 4)
  # Not vacuous: each worker stepped its own φ with its own proxy.
  phi = inline_state.opt_state.outer_params
  assert all(not np.array_equal(np.asarray(x[0]), np.asarray(x[1])) for x in jax.tree.leaves(phi))
  # The bytes of the same plan overlapped without eager (τ = 1 < H: sends issued with 4 and 7).
  _, plain, _, _ = _train(tmp_path, "plain", **{
      "algorithm": "streaming_diloco", "outer.eager": False, "outer.overlap_steps": 1,
      "outer.overlap_executor": "inline"})
  assert inline_summary["bytes_sent_per_worker"] == plain["bytes_sent_per_worker"]
  assert inline_summary["bytes_sent_per_worker"]["total"] > 0
  # A resume with the first mean in flight (sent with step 4, landing after step 6) and each
  # worker's φ_m, outer state and own Δ in the checkpoint is bit-identical.
  _train(tmp_path, "resumed", stop_at_step=5, **{"outer.overlap_executor": "inline",
                                                  "checkpoint.every": 5})
  _, _, resumed_state, _ = _train(tmp_path, "resumed", **{"outer.overlap_executor": "inline"})
  for x, y in zip(jax.tree.leaves(inline_state), jax.tree.leaves(resumed_state),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_two_outer_steps_late_on_the_thread_equal_inline_and_resume_with_two_means_in_flight(
    tmp_path):
  """τ = 2H = 6 for 10 steps: sends issued with steps 4, 7 and 10 (lanes 0, 1, 0); lane 0's first
  mean lands at step 9, lane 1's never within the run. The thread carries two means of one fragment
  at once; a run stopped at step 8 (both in flight) resumes bit for bit."""
  late = {"outer.overlap_steps": 6, "num_steps": 10}
  _, _, inline_state, _ = _train(tmp_path, "inline", **late, **{"outer.overlap_executor": "inline"})
  _, _, threaded_state, issued = _train(tmp_path, "thread", **late,
                                        **{"outer.overlap_executor": "thread"})
  assert [(i.step, i.name) for i in issued] == [(4, "fragment 0"), (7, "fragment 0, lane 1"),
                                                (10, "fragment 0")]
  testing.assert_states_within(threaded_state, inline_state, 10, 2 + 3 + 4)
  # the lanes hold different means: lane 1's (sent with 7) is still in flight at the end
  in_flight = inline_state.opt_state.comm.in_flight
  lane0, lane1 = (jax.tree.leaves(in_flight[n]) for n in ("fragment 0", "fragment 0, lane 1"))
  assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(lane0, lane1))
  _train(tmp_path, "resumed", stop_at_step=8, **late, **{"outer.overlap_executor": "inline",
                                                          "checkpoint.every": 8})
  _, _, resumed_state, _ = _train(tmp_path, "resumed", **late,
                                  **{"outer.overlap_executor": "inline"})
  for x, y in zip(jax.tree.leaves(inline_state), jax.tree.leaves(resumed_state), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
