"""Fragment state keyed by parameter path: shardings under fsdp, optax.tree_map_params, fragment
rules as data (callable, table, config), extra arguments for the inner optimizer, injected outer
hyperparameters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import lowcomm_jax
from lowcomm_jax import mesh as mesh_lib, testing
from lowcomm_jax.optim import fragments as frag_lib, schedule as schedule_lib
from lowcomm_jax.testing import layered_problem, tiny_config
from lowcomm_jax.train import Trainer

is_masked = lambda x: isinstance(x, optax.MaskedNode)


def run(tx, params, batches_r, loss_fn, use_phase=True, with_value=False):
  """`tx` over stacked replicas with vmap, jitted; with_value passes the loss as `value=` to
  `update`."""
  params_r, state = tx.init_replicated(params, batches_r.shape[1])

  def step(p, s, batch, phase):
    value, grads = jax.value_and_grad(loss_fn)(p, batch)
    extra = {"value": value} if with_value else {}
    updates, s = tx.update(grads, s, p, phase=phase, **extra)
    return optax.apply_updates(p, updates), s

  programs = {}  # one compiled step per phase (the phase picks what the step program does)
  for i, batch_r in enumerate(batches_r):
    phase = tx.phase_at(i + 1) if use_phase else None
    if phase not in programs:
      programs[phase] = jax.jit(jax.vmap(
          lambda p, s, b, ph=phase: step(p, s, b, ph), in_axes=(0, tx.state_axes, 0),
          out_axes=(0, tx.state_axes), axis_name="replica"))
    params_r, state = programs[phase](params_r, state, batch_r)
  return params_r, state


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


# -- shardings -------------------------------------------------------------------------------------

def param_shaped_fields(opt_state):
  """(name, sub-tree keyed like the parameters, has a leading replica axis) of every param-shaped
  part."""
  if isinstance(opt_state, lowcomm_jax.optim.NoLoCoState):
    return [("slow", opt_state.slow, True), ("momentum", opt_state.momentum, True)]
  fields = [("outer_params", opt_state.outer_params, False)]
  for p, (trace, _) in enumerate(opt_state.outer_states):
    # outer Nesterov: (TraceState, EmptyState)
    fields.append((f"outer_states[{p}].trace", trace.trace, False))
  fields += [(f"in_flight[{n}]", t, False) for n, t in opt_state.comm.in_flight.items()]
  fields += [(f"residuals[{n}]", t, True) for n, t in opt_state.comm.residuals.items()]
  return fields


@pytest.mark.parametrize("algorithm", ["streaming_diloco", "noloco"])
def test_under_fsdp_every_leaf_of_the_outer_state_is_sharded_like_its_parameter(
  tmp_path, algorithm
):
  changes = {"algorithm": algorithm, "num_replicas": 2, "mesh.replica": 2, "mesh.data": 4,
             "sharding.layout": "fsdp", "noloco.sync_every": 6}
  if algorithm == "streaming_diloco":  # two one-layer block fragments (slices [1, ...]) + non-block
    changes.update({"outer.sync_every": 6, "outer.num_fragments": 2, "outer.overlap_steps": 1,
                    "outer.codec": "e3m0", "outer.error_feedback": True})
  trainer = Trainer(tiny_config(**changes), tmp_path)
  opt_state = trainer.init_state().opt_state
  specs = {frag_lib.path_name(k): tuple(s) for k, s in jax.tree_util.tree_flatten_with_path(
      trainer.param_specs, is_leaf=lambda x: isinstance(x, P))[0]}
  sharded_leaves, fields = 0, param_shaped_fields(opt_state)
  assert len(fields) == (2 if algorithm == "noloco" else 1 + 3 * 3)
  for name, tree, per_replica in fields:
    leaves = frag_lib.flatten(tree)
    assert leaves, name
    for path, leaf in leaves.items():
      expected = P(*((mesh_lib.REPLICA,) if per_replica else ()), *specs[path])
      assert leaf.sharding.is_equivalent_to(NamedSharding(trainer.mesh, expected), leaf.ndim), (
          f"{name} {path}: {leaf.sharding.spec} instead of {expected}")
      sharded_leaves += mesh_lib.DATA in specs[path]
  assert sharded_leaves > len(fields)  # fsdp shards most of them over `data`


def test_state_specs_give_a_layer_slice_its_parameters_spec_and_replicate_the_rest():
  params = {"blocks": {"w": jax.ShapeDtypeStruct((4, 8, 2), jnp.float32)},
            "head": jax.ShapeDtypeStruct((8, 2), jnp.float32)}
  specs = {"blocks": {"w": P(None, "data", None)}, "head": P("data", None)}
  state = {"trace": {"blocks": {"w": jax.ShapeDtypeStruct((2, 8, 2), jnp.float32)},
                     "head": optax.MaskedNode()},
           "count": jax.ShapeDtypeStruct((), jnp.int32),
           # a head-like path would need head's shape
           "other": jax.ShapeDtypeStruct((8, 3), jnp.float32),
           "head": jax.ShapeDtypeStruct((2, 8, 2), jnp.float32)}  # batched: a replica axis in front
  batched = {"trace": False, "count": False, "other": False, "head": True}
  got = lowcomm_jax.sharding.state_specs(state, params, specs, batched)
  assert got == {"trace": {"blocks": {"w": P(None, "data", None)}, "head": optax.MaskedNode()},
                 "count": P(), "other": P(), "head": P("replica", "data", None)}
  sharded_layers = {"blocks": {"w": P("data", None, None)}, "head": P()}
  assert lowcomm_jax.sharding.state_specs(state["trace"], params, sharded_layers) == {
      # a slice of a sharded axis is not that spec
      "blocks": {"w": P()}, "head": optax.MaskedNode()}


# -- optax.tree_map_params -------------------------------------------------------------------------

def test_tree_map_params_reaches_every_param_shaped_leaf_and_only_those():
  params, xs, loss_fn = layered_problem()
  tx = lowcomm_jax.streaming_diloco(optax.adam(0.03), lowcomm_jax.outer_nesterov(), sync_every=6,
                                    fragments=2, overlap_steps=1, codec="e3m0", error_feedback=True)
  _, state = run(tx, params, xs[:4], loss_fn)
  mapped = optax.tree_map_params(tx, lambda x: x + 1, state)
  plus_one = lambda a, b: assert_trees_equal(a, jax.tree.map(lambda x: x + 1, b))
  plus_one(mapped.outer_params, state.outer_params)
  plus_one(mapped.comm.in_flight, state.comm.in_flight)
  plus_one(mapped.comm.residuals, state.comm.residuals)
  plus_one([s[0].trace for s in mapped.outer_states], [s[0].trace for s in state.outer_states])
  plus_one((mapped.inner_state[0].mu, mapped.inner_state[0].nu),
           (state.inner_state[0].mu, state.inner_state[0].nu))
  assert_trees_equal((mapped.count, mapped.nonfinite, mapped.inner_state[0].count),
                     (state.count, state.nonfinite, state.inner_state[0].count))
  # With a parameter-shaped argument (here each parameter's path), as for optax.masked: every
  # fragment's outer momentum gets exactly its own parameters' entries.
  names = jax.tree_util.tree_map_with_path(lambda k, _: frag_lib.path_name(k), params)
  labelled = optax.tree_map_params(tx, lambda x, name: x if is_masked(x) else name, state, names,
                                   transform_non_params=lambda _: None, is_leaf=is_masked)
  for frag, outer_state in zip(tx.fragments(params), labelled.outer_states):
    assert frag_lib.flatten(outer_state[0].trace) == {p: p for p, _ in frag.leaves}
  assert labelled.count is None and frag_lib.flatten(labelled.outer_params) == {
    p: p for p in frag_lib.flatten(names)
  }


# -- fragment rules as data ------------------------------------------------------------------------

def test_a_callable_a_regex_table_and_an_explicit_schedule_give_the_same_run():
  params, xs, loss_fn = layered_problem()
  rules = [(r"blocks/w", 0), (r"blocks/.*", 1), (r".*", 2)]
  inner, outer = optax.adam(0.03), lowcomm_jax.outer_nesterov()
  by_callable = lowcomm_jax.streaming_diloco(inner, outer, sync_every=6, overlap_steps=1,
                                             fragments=lambda p: frag_lib.rule_fragments(p, rules))
  with pytest.raises(ValueError, match=r"call init\(params\) or fragments\(params\) first"):
    by_callable.phase_at(1)
  a = run(by_callable, params, xs, loss_fn)
  assert by_callable.schedule.num_fragments == 3 and by_callable.phase_at(3).send == (0,)  # τ = 1
  b = run(lowcomm_jax.streaming_diloco(inner, outer, sync_every=6, overlap_steps=1,
                                       fragments=rules),
          params, xs, loss_fn)
  c = run(lowcomm_jax.optim.StreamingDiLoCo(inner, outer, schedule_lib.make_schedule(3, 6, 1),
                                            lambda p: frag_lib.rule_fragments(p, rules)), params,
          xs, loss_fn)
  assert_trees_equal(a, b)
  assert_trees_equal(a, c)
  with pytest.raises(ValueError,
                     match=r"^sync_every \(H=4\) must be divisible by the number of "
                     r"fragments \(P=3"):
    lowcomm_jax.streaming_diloco(
      inner, outer, sync_every=4, fragments=lambda p: frag_lib.rule_fragments(p, rules)
    ).init(params)


def test_a_tree_of_block_leaves_only_asks_for_fold():
  params = {"blocks": {"w": jnp.zeros((2, 3))}}
  tx = lowcomm_jax.streaming_diloco(optax.sgd(0.1), sync_every=6, fragments=2)  # 2 + 1 rows
  with pytest.raises(ValueError, match='only block leaves; use non_block_fragment="fold"'):
    tx.init(params)


def test_parse_rules():
  assert frag_lib.parse_rules("blocks/attn/.*:0, blocks/.*:1,(?:x|y):z.*:2") == (
      ("blocks/attn/.*", 0), ("blocks/.*", 1), ("(?:x|y):z.*", 2))


@pytest.mark.parametrize("changes,message", [
    ({"outer.fragment_rules": "blocks/.*"},
     r"outer.fragment_rules must be comma-separated 'regex:index'"),
    ({"outer.fragment_rules": "blocks/.*:0,.*:2"},
     r"fragment indices must be 0, 1, ..., F-1 with none skipped"),
    ({"outer.fragment_rules": "blocks/(:0,.*:1"},
     r"outer.fragment_rules: 'blocks/\(' is not a regular expression"),
    ({"outer.fragment_rules": "blocks/.*:0,.*:1", "outer.sync_every": 5},
     r"outer.sync_every \(H=5\) must be divisible by the number of fragments \(P=2"),
    ({"outer.fragment_rules": "blocks/.*:0,.*:1", "outer.num_fragments": 2},
     r"outer.num_fragments must be 1 when outer.fragment_rules is set"),
    ({"outer.fragment_rules": "attn.*:0,.*:1"},
     r"outer.fragment_rules: the rules \['attn.\*'\] match no parameter"),
    ({"outer.fragment_rules": ".*:0", "algorithm": "diloco"}, r"1/0/0/'' for algorithm=diloco"),
])
def test_bad_fragment_rules_are_named_before_compute(tmp_path, changes, message):
  base = {"algorithm": "streaming_diloco", "num_replicas": 2, "outer.sync_every": 6}
  with pytest.raises(ValueError, match=message):
    Trainer(tiny_config(**{**base, **changes}), tmp_path / "w")
  assert not (tmp_path / "w").exists()


def test_fragment_rules_from_the_config_through_the_trainer(tmp_path):
  base = {"algorithm": "streaming_diloco", "num_replicas": 2, "num_steps": 6,
          "outer.sync_every": 6}
  whole = Trainer(tiny_config(**base), tmp_path / "whole")
  whole_summary, whole_final = testing.run_to_end(whole)
  one_rule = Trainer(tiny_config(**base, **{"outer.fragment_rules": ".*:0"}), tmp_path / "one")
  _, one_rule_final = testing.run_to_end(one_rule)
  # one rule matching all = the whole model
  assert_trees_equal(whole_final.state, one_rule_final.state)
  rules = Trainer(tiny_config(**base,
                              **{"outer.fragment_rules": "blocks/attn/.*:0,blocks/.*:1,.*:2"}),
                  tmp_path / "rules")
  summary, rules_final = testing.run_to_end(rules)
  assert rules.fragment_names == ["rule fragment 0", "rule fragment 1", "rule fragment 2"]
  params = jax.tree.map(lambda x: x[0], rules_final.state.params)
  attn = sum(v.size for p, v in frag_lib.flatten(params).items() if p.startswith("blocks/attn/"))
  sent = summary["bytes_sent_per_worker"]
  # every parameter once per H
  assert sent["total"] == whole_summary["bytes_sent_per_worker"]["total"]
  assert sent["peak_per_sync"] < whole_summary["bytes_sent_per_worker"]["peak_per_sync"]
  assert any(e.name == "fragment 0" and e.payload_bytes == 4 * attn for e in rules.program(
      rules.algorithm.phase_at(2), rules_final.state)[1])


# -- optax fit: extra arguments and injected hyperparameters ---------------------------------------

@pytest.mark.parametrize("use_phase", [True, False])
def test_extra_args_reach_the_inner_optimizer(use_phase):
  # One replica with outer SGD lr 1 is plain inner training, so DiLoCo around optax.polyak_sgd
  # (whose step size (f − f*) / ‖g‖² needs the loss as `value=`) must follow plain polyak_sgd.
  params, xs, loss_fn = layered_problem(replicas=1, steps=8)
  inner = optax.polyak_sgd(max_learning_rate=0.5)
  tx = lowcomm_jax.diloco(inner, optax.sgd(1.0), sync_every=3)
  params_r, _ = run(tx, params, xs, loss_fn, use_phase=use_phase, with_value=True)
  plain, state = params, inner.init(params)
  for batch in xs[:, 0]:
    value, grads = jax.value_and_grad(loss_fn)(plain, batch)
    updates, state = inner.update(grads, state, plain, value=value)
    plain = optax.apply_updates(plain, updates)
  # φ − 1·(φ − θ) rounds to θ within u·|φ − θ| per outer step: 2 roundings per step.
  testing.assert_trees_within(jax.tree.map(lambda a: a[0], params_r), plain,
                              testing.trajectory_error_bound(plain, len(xs), 2))
  assert not np.allclose(jax.tree.leaves(params_r)[0][0], jax.tree.leaves(params)[0])
  noloco = lowcomm_jax.noloco(inner, num_replicas=2, sync_every=3)
  run(noloco, params, jnp.concatenate([xs, xs], 1)[:3], loss_fn, use_phase=use_phase,
      with_value=True)


def three_parameter_rounds(outer, rounds):
  """The hand-worked DiLoCo problem of test_diloco: loss_m = ½‖w − y_m‖², inner SGD ½, M = 2, H =
  2."""
  targets = jnp.array([[2.0, 0.0, -2.0], [0.0, 4.0, 2.0]])
  batches = jnp.broadcast_to(targets, (2 * rounds, 2, 3))
  tx = lowcomm_jax.diloco(optax.sgd(0.5), outer, sync_every=2)
  return run(tx, jnp.zeros(3), batches, lambda w, y: 0.5 * jnp.sum((w - y) ** 2))


def test_injected_outer_learning_rate_and_momentum():
  fixed = three_parameter_rounds(lowcomm_jax.outer_nesterov(0.7, 0.9), 2)
  injected = three_parameter_rounds(optax.inject_hyperparams(lowcomm_jax.outer_nesterov)(
      learning_rate=0.7, momentum=0.9), 2)
  for a, b in zip(jax.tree.leaves((fixed[0], fixed[1].outer_params)),
                  jax.tree.leaves((injected[0], injected[1].outer_params))):
    np.testing.assert_array_equal(a, b)
  # Round 2 at half the learning rate: φ₂ = φ₁ − 0.35·(Δ + 0.9·b) with φ₁ = (0.9975, 1.995, 0) and
  # Δ + 0.9·b = (−0.6110625, −1.222125, 0) (test_diloco's hand-worked rounds), so
  # φ₂ = (0.9975 + 0.35·0.6110625, 1.995 + 0.35·1.222125, 0).
  halved = optax.inject_hyperparams(lowcomm_jax.outer_nesterov)(
      learning_rate=lambda outer_step: jnp.where(outer_step < 1, 0.7, 0.35), momentum=0.9)
  _, state = three_parameter_rounds(halved, 2)
  # float32 of the hand values: ≤ 16 roundings per round of values ≤ 4 (test_diloco's count), 2
  # rounds.
  round_bound = testing.operation_error_bound(4.0, 16)
  testing.assert_within(state.outer_params, [1.211371875, 2.42274375, 0.0], 2 * round_bound, "φ")
  assert float(state.outer_states[0].hyperparams["learning_rate"]) == np.float32(0.35)
  testing.assert_within(state.outer_states[0].inner_state[0].trace, [-0.676875, -1.35375, 0.0],
                        2 * round_bound, "b")
  # Traced μ: one jitted function of (η, μ) gives plain SGD's step at μ = 0 and Nesterov's at μ =
  # 0.9.
  step = jax.jit(lambda lr, mu, g: lowcomm_jax.outer_nesterov(lr, mu).update(
      g, lowcomm_jax.outer_nesterov(lr, mu).init(g))[0])
  g = jnp.array([1.0, -2.0])
  np.testing.assert_array_equal(step(0.5, 0.0, g), -0.5 * g)  # halving is exact in float32
  # g + 0.9·g, times 0.5: 0.9's own rounding and 2 more, at |1.9·g|
  testing.assert_within(step(0.5, 0.9, g), -0.5 * 1.9 * g,
                        testing.operation_error_bound(np.abs(1.9 * g), 3))
