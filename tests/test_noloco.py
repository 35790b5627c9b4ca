"""NoLoCo: gossip outer steps in random groups with no all-reduce."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import lowcomm_jax
from lowcomm_jax import comm, hlo, testing
from lowcomm_jax.testing import mlp_problem, run_replicas


def test_one_group_of_all_and_gamma0_equals_diloco_with_heavy_ball():
  params, xs, loss_fn = mlp_problem(replicas=4)
  inner = optax.adam(0.05)
  nl = lowcomm_jax.noloco(inner, num_replicas=4, sync_every=3, group_size=4, momentum=0.5,
                          learning_rate=0.7, gamma=0.0)
  dl = lowcomm_jax.diloco(inner, optax.sgd(0.7, momentum=0.5), sync_every=3)
  a, sa = run_replicas(nl, params, xs, loss_fn, use_phase=True)
  b, sb = run_replicas(dl, params, xs, loss_fn)
  # The same outer step written as two formulas (a group mean of 4 replicas vs the all-reduce's
  # mean, momentum and step in other orders): ≤ 8 roundings per outer step plus a sum of 4, 4 outer
  # steps.
  bound = testing.trajectory_error_bound(b, 4, 8 + 4)
  for slow_r, outer in zip(jax.tree.leaves(sa.slow), jax.tree.leaves(sb.outer_params)):
    testing.assert_within(slow_r, np.broadcast_to(outer, slow_r.shape), bound, "φ")
  testing.assert_trees_within(a, b, bound, "θ")


def test_one_pair_two_outer_steps_by_hand():
  # loss_m = ½‖w − y_m‖², inner SGD lr ½: w ← ½w + ½y_m; y_0 = (2, 0, −2), y_1 = (0, 4, 2); H = 2;
  # α = 0.5, β = γ = 0.7. Replica 0 starts at φ_0 = 0, replica 1 at φ_1 = (1, 1, 1).
  # Round 1: θ_0 = (1.5, 0, −1.5), θ_1 = (0.25, 3.25, 1.75); mean Δ = (−0.375, −1.125, 0.375),
  #   mean φ = (0.5, 0.5, 0.5); δ_0 = (0.6125, 1.1375, 0.0875), δ_1 = (−0.0875, 0.4375, −0.6125).
  # Round 2: θ_0 = (1.653125, 0.284375, −1.478125), θ_1 = (0.228125, 3.359375, 1.596875);
  #   mean Δ = (−0.178125, −0.534375, 0.178125), mean φ = (0.7625, 1.2875, 0.2375);
  #   δ_0 = (0.5359375, 1.0478125, 0.0240625), δ_1 = (−0.0240625, 0.4878125, −0.5359375);
  #   φ_0 = (1.1484375, 2.1853125, 0.1115625), φ_1 = (0.8884375, 1.9253125, −0.1484375).
  tx = lowcomm_jax.noloco(optax.sgd(0.5), num_replicas=2, sync_every=2)
  targets = jnp.array([[2.0, 0.0, -2.0], [0.0, 4.0, 2.0]])
  params_r, state = tx.init_replicated(jnp.zeros(3), 2)
  start = jnp.array([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
  params_r, state = start, state._replace(slow=start)

  def step(p, s, y, phase):
    updates, s = tx.update(p - y, s, p, phase=phase)
    return p + updates, s

  # float32 of the hand values: ≤ 20 roundings per round (2 inner steps of 3, the two means' 4, the
  # outer step's 10 with the constants 0.7's own) of values ≤ 4 in magnitude.
  round_bound = testing.operation_error_bound(4.0, 20)
  for t in range(1, 5):
    ph = tx.phase_at(t)
    params_r, state = jax.vmap(
      lambda p, s, y: step(p, s, y, ph),
      in_axes=(0, tx.state_axes, 0),
      out_axes=(0, tx.state_axes),
      axis_name="replica",
    )(params_r, state, targets)
    if t == 2:
      testing.assert_within(state.momentum, [[0.6125, 1.1375, 0.0875], [-0.0875, 0.4375, -0.6125]],
                            round_bound, "δ after round 1")
  testing.assert_within(state.slow, [[1.1484375, 2.1853125, 0.1115625],
                                     [0.8884375, 1.9253125, -0.1484375]], 2 * round_bound,
                        "φ after round 2")
  # θ + (φ − θ) after the restart: two roundings of values ≤ 4.
  testing.assert_within(params_r, state.slow, testing.operation_error_bound(4.0, 2), "θ restarted")


def test_groupings_partition_the_replicas_vary_and_are_reproducible():
  tx = lowcomm_jax.noloco(optax.sgd(0.1), num_replicas=8, sync_every=5, seed=3)
  again = lowcomm_jax.noloco(optax.sgd(0.1), num_replicas=8, sync_every=5, seed=3)
  other = lowcomm_jax.noloco(optax.sgd(0.1), num_replicas=8, sync_every=5, seed=4)
  seen = []
  for k in range(1, 21):
    groups = tx.groups_at(5 * k)
    assert sorted(groups.ravel().tolist()) == list(range(8)) and groups.shape == (4, 2)
    np.testing.assert_array_equal(groups, again.groups_at(5 * k))
    seen.append(tuple(map(tuple,
                          np.sort(groups, axis=1)[np.argsort(np.sort(groups, axis=1)[:, 0])])))
  assert len(set(seen)) > 5  # the pairing changes across outer steps
  assert any(not np.array_equal(tx.groups_at(5 * k), other.groups_at(5 * k)) for k in range(1, 6))
  assert tx.groups_at(4) is None and len({tx.phase_at(5 * k) for k in range(1, 200)}) <= 16


def test_compiled_sync_step_has_only_permutation_collectives():
  # One replica per device under jax.shard_map over the mesh axis `replica`. (Under vmap on sharded
  # inputs, XLA's partitioner lowers the batched ppermute to an all-gather, so NoLoCo runs over a
  # mesh with shard_map.)
  params, xs, loss_fn = mlp_problem(replicas=8, steps=2)
  tx = lowcomm_jax.noloco(optax.adam(0.05), num_replicas=8, sync_every=2)
  mesh = jax.make_mesh((8,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))
  params_r, state = tx.init_replicated(params, 8)
  axes = tx.state_axes._replace(count=P(), inner_state=P("replica"), slow=P("replica"),
                                momentum=P("replica"),
                                refused=P("replica"),
                                comm=comm.CommState(in_flight=P(), residuals=P("replica")))

  def step(p, s, b):
    p, b = jax.tree.map(lambda x: x[0], (p, b))
    s = s._replace(inner_state=jax.tree.map(lambda x: x[0], s.inner_state),
                   slow=jax.tree.map(lambda x: x[0], s.slow),
                   momentum=jax.tree.map(lambda x: x[0], s.momentum))
    updates, s = tx.update(jax.grad(loss_fn)(p, b), s, p, phase=tx.phase_at(2))
    add = lambda t: jax.tree.map(lambda x: x[None], t)
    s = s._replace(inner_state=add(s.inner_state), slow=add(s.slow), momentum=add(s.momentum))
    return add(optax.apply_updates(p, updates)), s

  sharded = jax.shard_map(step, mesh=mesh, in_specs=(P("replica"), axes, P("replica")),
                          out_specs=(P("replica"), axes))
  ledger = comm.Ledger()
  with ledger.recording():
    sync = jax.jit(sharded).lower(params_r, state, xs[0]).compile()
  kinds = {line.split("=")[1].split("(")[0].split()[-1] for line in hlo.collectives(sync.as_text())}
  assert kinds and kinds <= {"collective-permute", "collective-permute-start"}
  # Each replica sends its slow weights and its outer gradient to its one peer: 2 tensors of
  # float32.
  size = sum(x.size for x in jax.tree.leaves(params))
  assert [e.sent_bytes for e in ledger.entries] == [4 * size, 4 * size]


@pytest.mark.parametrize("group_size,message", [(3, "must be >= 2 and divide num_replicas=4"),
                                                (1, "must be >= 2 and divide num_replicas=4")])
def test_bad_group_size(group_size, message):
  with pytest.raises(ValueError, match=f"^group_size {message}"):  # the argument, not the key
    lowcomm_jax.noloco(optax.sgd(0.1), num_replicas=4, sync_every=2, group_size=group_size)
