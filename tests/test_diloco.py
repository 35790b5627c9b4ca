"""DiLoCo: equivalences, a hand-worked example, the compiled communication, resume and bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowcomm_jax
from lowcomm_jax import comm, testing
from lowcomm_jax.testing import mlp_problem, run_replicas, tiny_config
from lowcomm_jax.train import Trainer


@pytest.mark.parametrize("sync_every", [1, 3, 5])
def test_one_replica_with_outer_sgd_lr1_equals_plain_inner_training(sync_every):
  params, xs, loss_fn = mlp_problem(replicas=1)
  inner = optax.adamw(0.05)
  tx = lowcomm_jax.diloco(inner, optax.sgd(1.0), sync_every=sync_every)
  params_r, _ = run_replicas(tx, params, xs, loss_fn)
  plain, state = params, inner.init(params)
  for batch in xs[:, 0]:
    updates, state = inner.update(jax.grad(loss_fn)(plain, batch), state, plain)
    plain = optax.apply_updates(plain, updates)
  # φ − 1·(φ − θ) rounds to θ within u·|φ − θ| per outer step; 12 steps of 2 such roundings.
  testing.assert_trees_within(jax.tree.map(lambda a: a[0], params_r), plain,
                              testing.trajectory_error_bound(plain, 12, 2))


def test_h1_inner_sgd_outer_sgd_lr1_equals_data_parallel_on_the_larger_batch():
  params, xs, loss_fn = mlp_problem(replicas=4)
  tx = lowcomm_jax.diloco(optax.sgd(0.3), optax.sgd(1.0), sync_every=1)
  params_r, state = run_replicas(tx, params, xs, loss_fn)
  dp, sgd = params, optax.sgd(0.3)
  dp_state = sgd.init(dp)
  for batch_r in xs:  # one batch of M·B examples; equal-size shards make the mean loss the same
    updates, dp_state = sgd.update(jax.grad(loss_fn)(dp, batch_r.reshape(-1, 4)), dp_state, dp)
    dp = optax.apply_updates(dp, updates)
  # A mean of 4 replicas' gradients over 8 examples vs one gradient over 32: each step's sums of
  # ≤ 32 terms in another order, plus the outer step's 2 roundings, over 12 steps.
  bound = testing.trajectory_error_bound(dp, 12, 32 + 2)
  testing.assert_trees_within(params_r,
                              jax.tree.map(lambda b, a: np.broadcast_to(b, a.shape), dp, params_r),
                              bound, "replicas")
  testing.assert_trees_within(state.outer_params, dp, bound, "outer")


def test_outer_lr0_keeps_global_params_and_identical_data_equals_one_replica():
  params, xs, loss_fn = mlp_problem(replicas=4)
  frozen = lowcomm_jax.diloco(optax.adam(0.05), optax.sgd(0.0), sync_every=2)
  _, state = run_replicas(frozen, params, xs, loss_fn)
  for g, p in zip(jax.tree.leaves(state.outer_params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(g, p)
  tx = lowcomm_jax.diloco(optax.adam(0.05), lowcomm_jax.outer_nesterov(0.7, 0.9), sync_every=3)
  same = jnp.broadcast_to(xs[:, :1], xs.shape)
  many, state_many = run_replicas(tx, params, same, loss_fn)
  one, state_one = run_replicas(tx, params, xs[:, :1], loss_fn)
  # The mean of 4 equal replicas rounds (a sum of 4 terms) where one replica's does not, per outer
  # step (4 of them in 12 steps).
  bound = testing.trajectory_error_bound(one, 4, 4)
  for a, b in zip(jax.tree.leaves((many, state_many.outer_params)),
                  jax.tree.leaves((one, state_one.outer_params))):
    testing.assert_within(a, np.broadcast_to(b, a.shape) if a.ndim == b.ndim else b, bound)


def test_traced_phase_equals_host_phase():
  params, xs, loss_fn = mlp_problem(replicas=2)
  tx = lowcomm_jax.diloco(optax.adam(0.05), lowcomm_jax.outer_nesterov(), sync_every=4)
  a, sa = run_replicas(tx, params, xs, loss_fn, use_phase=False)
  b, sb = run_replicas(tx, params, xs, loss_fn, use_phase=True)
  for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb))):
    np.testing.assert_array_equal(x, y)  # the same arithmetic; only how the phase is chosen differs


def test_three_parameters_two_rounds_by_hand():
  # loss_m(w) = ½‖w − y_m‖², so the gradient is w − y_m; inner SGD with lr ½ gives w ← ½w + ½y_m.
  # M = 2, H = 2, φ₀ = 0, y₀ = (2, 0, −2), y₁ = (0, 4, 2); outer Nesterov lr 0.7, μ 0.9.
  # Round 1: replica 0: (1, 0, −1) → (1.5, 0, −1.5); replica 1: (0, 2, 1) → (0, 3, 1.5).
  #   Δ = φ − mean θ = −(0.75, 1.5, 0); b = Δ; φ ← φ − 0.7·(Δ + 0.9·b) = 1.33·(0.75, 1.5, 0)
  #   = (0.9975, 1.995, 0), and both replicas restart from φ.
  # Round 2: replica 0 → (1.749375, 0.49875, −1.5); replica 1 → (0.249375, 3.49875, 1.5);
  #   mean θ = (0.999375, 1.99875, 0); Δ = (−0.001875, −0.00375, 0);
  #   b = 0.9·b + Δ = (−0.676875, −1.35375, 0); Δ + 0.9·b = (−0.6110625, −1.222125, 0);
  #   φ ← φ − 0.7·that = (1.42524375, 2.8504875, 0).
  targets = jnp.array([[2.0, 0.0, -2.0], [0.0, 4.0, 2.0]])
  batches = jnp.broadcast_to(targets, (4, 2, 3))
  loss_fn = lambda w, y: 0.5 * jnp.sum((w - y) ** 2)
  tx = lowcomm_jax.diloco(optax.sgd(0.5), lowcomm_jax.outer_nesterov(0.7, 0.9), sync_every=2)
  # float32 of the hand values: ≤ 16 roundings per round (2 inner steps of 3, the mean's 2, the
  # outer step's 6 and the 0.7 and 0.9 constants' own) of values ≤ 4 in magnitude.
  round_bound = testing.operation_error_bound(4.0, 16)
  params_r, state = run_replicas(tx, jnp.zeros(3), batches[:2], loss_fn)
  testing.assert_within(state.outer_params, [0.9975, 1.995, 0.0], round_bound, "φ after round 1")
  testing.assert_within(params_r, [[0.9975, 1.995, 0.0]] * 2, round_bound, "θ after round 1")
  params_r, state = run_replicas(tx, jnp.zeros(3), batches, loss_fn)
  testing.assert_within(state.outer_params, [1.42524375, 2.8504875, 0.0], 2 * round_bound,
                        "φ after round 2")
  testing.assert_within(state.outer_states[0][0].trace, [-0.676875, -1.35375, 0.0], 2 * round_bound,
                        "b after round 2")


def diloco_config(**changes):
  base = {"algorithm": "diloco", "num_replicas": 2, "outer.sync_every": 4,
          "outer_optimizer.learning_rate": 0.7, "outer_optimizer.momentum": 0.9}
  base.update(changes)
  return tiny_config(**base)


COLLECTIVES = re.compile(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                         r"(-start)?\(")


def test_compiled_non_sync_step_has_no_collective_and_the_ledger_counts_the_sync(tmp_path):
  c = diloco_config(num_replicas=8, **{"mesh.replica": 8, "mesh.data": 1})
  trainer = Trainer(c, tmp_path)
  state = trainer.init_state()
  inner_program, inner_entries = trainer.program(trainer.algorithm.phase_at(1), state)
  sync_program, sync_entries = trainer.program(trainer.algorithm.phase_at(4), state)
  assert not COLLECTIVES.findall(inner_program.as_text()) and not inner_entries
  assert "all-reduce" in sync_program.as_text()
  # One fragment of every parameter in float32, in a ring over M = 8: each sends 2·7/8 of it.
  assert len(sync_entries) == 1
  assert sync_entries[0].payload_bytes == 4 * trainer.num_params
  assert sync_entries[0].sent_bytes == pytest.approx(2 * 7 / 8 * 4 * trainer.num_params)


def test_run_reports_bytes_and_evaluates_the_global_params(tmp_path):
  c = diloco_config(num_steps=8, **{"eval.every": 8})
  trainer = Trainer(c, tmp_path)
  summary, trainer_final = testing.run_to_end(trainer)
  sent = summary["bytes_sent_per_worker"]
  per_sync = comm.ring_factor(2) * 4 * trainer.num_params  # = 4 bytes per parameter at M = 2
  assert sent["total"] == pytest.approx(2 * per_sync) and sent["peak_per_sync"] == pytest.approx(
    per_sync
  )
  assert sent["bits_per_param_per_step"] == pytest.approx(
    8 * 2 * per_sync / (trainer.num_params * 8)
  )
  state = trainer_final.state
  # Right after the sync at step 8 every replica equals φ (up to the rounding of θ + (φ − θ), since
  # optax transformations return updates, not new values).
  # θ + (φ − θ): two roundings of values within twice the leaf's scale (θ is a few inner steps from
  # φ).
  for g, p in zip(jax.tree.leaves(state.opt_state.outer_params), jax.tree.leaves(state.params)):
    testing.assert_within(np.asarray(p), np.broadcast_to(np.asarray(g), p.shape),
                          testing.operation_error_bound(2 * np.max(np.abs(np.asarray(g))), 2))
  eval_loss = trainer.evaluate(
    trainer.eval_fn(),
    state,
    __import__("lowcomm_jax.data.pipeline", fromlist=["x"]).eval_batches(
      trainer_eval_tokens(c), c.data.seq_len, 8, 4
    ),
  )["eval_loss"]
  assert eval_loss == summary["final_eval_loss"]  # the same program on the same state and batches


def trainer_eval_tokens(c):
  from lowcomm_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  return pipeline.load_splits(c.data.corpus, c.data.eval_permille).eval


@pytest.mark.parametrize("num_replicas,meshes",
                         [(2, [{"replica": 1, "data": 1}, {"replica": 2, "data": 4}]),
                                                 (8,
                                                  [{"replica": 1, "data": 1},
                                                   {"replica": 8, "data": 1}])])
def test_vmap_simulation_equals_device_meshes(tmp_path, num_replicas, meshes):
  finals = []
  for i, mesh in enumerate(meshes):
    c = diloco_config(num_steps=8, num_replicas=num_replicas,
                      **{f"mesh.{k}": v for k, v in mesh.items()})
    devices = jax.devices()[:mesh["replica"] * mesh["data"]]
    t = Trainer(c, tmp_path / str(i), devices=devices)
    finals.append(testing.run_to_end(t)[1].state)
  # A mesh sums the gradient's and the outer mean's terms in other orders than vmap on one device:
  # per step at most the tiny model's longest chain of sums (≈ 2·(4·32 + 16 + 64 + 64) + 32 + a
  # batch of 4·64 tokens ≈ 1000 terms), over 8 steps, at each leaf's scale.
  testing.assert_trees_within(
    finals[0], finals[1], lambda b: testing.trajectory_error_bound(b, 8, 1000) if np.size(b) else 0
  )


def test_bad_input_is_named_before_compute(tmp_path):
  with pytest.raises(ValueError, match=r"outer.sync_every \(H\) must be an integer >= 1"):
    Trainer(diloco_config(**{"outer.sync_every": 0}), tmp_path / "a")
  with pytest.raises(ValueError, match=r"mesh .* needs 16 devices but 8 are available"):
    Trainer(diloco_config(num_replicas=16, **{"mesh.replica": 16, "mesh.data": 1}), tmp_path / "b")
  with pytest.raises(ValueError, match=r"mesh.replica must be a divisor of num_replicas=3"):
    Trainer(diloco_config(num_replicas=3, **{"mesh.replica": 2, "mesh.data": 1}), tmp_path / "c")
  with pytest.raises(TypeError, match=r"outer optimizer must be an optax.GradientTransformation"):
    lowcomm_jax.diloco(optax.sgd(0.1), outer=lambda g: g, sync_every=2)
  with pytest.raises(ValueError, match=r"^sync_every \(H\) must be an integer >= 1"):
    lowcomm_jax.diloco(optax.sgd(0.1), sync_every=0)  # the Python API names its argument
  assert not any(tmp_path.iterdir())


API_REFUSALS = {  # a bad argument of the optax-style API → the start of its one-line refusal
    "diloco sync_every": (lambda: lowcomm_jax.diloco(optax.sgd(1.0), sync_every=0),
                          "sync_every (H)"),
    "fragments": (lambda: lowcomm_jax.streaming_diloco(optax.sgd(1.0), fragments=0),
                  "fragments must"),
    "overlap_steps": (lambda: lowcomm_jax.streaming_diloco(optax.sgd(1.0), sync_every=4,
                                                          overlap_steps=4), "overlap_steps (τ=4)"),
    "merge_alpha": (lambda: lowcomm_jax.streaming_diloco(optax.sgd(1.0), merge_alpha=2.0),
                    "merge_alpha (α)"),
    "error_feedback": (lambda: lowcomm_jax.streaming_diloco(optax.sgd(1.0), error_feedback=True),
                       "error_feedback needs a lossy codec"),
    "codec_kernels": (lambda: lowcomm_jax.streaming_diloco(optax.sgd(1.0), codec="int8",
                                                          codec_kernels="gpu"),
                      "codec_kernels must"),
    "overlap_anchor": (lambda: lowcomm_jax.streaming_diloco(optax.sgd(1.0), overlap_anchor="late"),
                       "overlap_anchor must"),
    "group_size": (lambda: lowcomm_jax.noloco(optax.sgd(1.0), 4, group_size=3), "group_size must"),
    "top_k": (lambda: lowcomm_jax.sparseloco(optax.sgd(1.0), top_k=0), "top_k must"),
    "bits": (lambda: lowcomm_jax.sparseloco(optax.sgd(1.0), bits=3), "bits must"),
    "sparseloco merge_alpha": (lambda: lowcomm_jax.sparseloco(optax.sgd(1.0), merge_alpha=2.0),
                               "merge_alpha (α)"),
    # checked when init first sees the parameters
    "fragment rules": (lambda: lowcomm_jax.streaming_diloco(
        optax.sgd(1.0), fragments=[("nothing", 0)], sync_every=2).init({"w": jnp.zeros(2)}),
        "fragments: the rules ['nothing'] match no parameter"),
}


def test_the_python_api_names_its_arguments_not_config_keys():
  for name, (call, start) in API_REFUSALS.items():
    with pytest.raises(ValueError, match=None) as error:
      call()
    message = str(error.value)
    assert message.startswith(start), (name, message)
    assert not re.search(r"\b(outer|noloco|sparseloco)\.\w", message), (name, message)
  # The Trainer builds its algorithm through lowcomm_jax.optim, whose refusals name config keys.
  with pytest.raises(ValueError, match=r"^outer\.sync_every \(H\)"):
    lowcomm_jax.optim.diloco(optax.sgd(1.0), sync_every=0)


def test_the_global_model_and_the_syncs_as_docs_api_reads_them():
  """docs/api.md: φ is `state.outer_params` (one copy, not stacked); `tx.phase_at(step).receive`
  names the fragments merged after inner step `step`, and then every replica holds φ."""
  params, xs, loss_fn = mlp_problem(replicas=2)
  tx = lowcomm_jax.diloco(optax.adamw(0.05), sync_every=3)
  params_r, state = tx.init_replicated(params, num_replicas=2)

  def step(p, s, batch):
    updates, s = tx.update(jax.grad(loss_fn)(p, batch), s, p)
    return optax.apply_updates(p, updates), s

  step_r = jax.jit(jax.vmap(step, in_axes=(0, tx.state_axes, 0), out_axes=(0, tx.state_axes),
                            axis_name="replica"))
  for s, batch in enumerate(xs[:6], start=1):
    params_r, state = step_r(params_r, state, batch)
    phi = state.outer_params
    assert jax.tree.leaves(phi)[0].shape == jax.tree.leaves(params)[0].shape
    synced = tx.phase_at(s).receive == (0,)
    assert synced == (s % 3 == 0)
    same = all(np.array_equal(np.asarray(r[i]), np.asarray(f))
               for r, f in zip(jax.tree.leaves(params_r), jax.tree.leaves(phi)) for i in range(2))
    assert same == synced, s
