"""Streaming DiLoCo: fragments, the staggered schedule, overlap τ and merge α, the compiled HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lowcomm_jax
from lowcomm_jax import comm, hlo, testing
from lowcomm_jax.optim import fragments as frag_lib, schedule as schedule_lib
from lowcomm_jax.testing import (
  layered_problem,
  read_metrics,
  run_replicas,
  streaming_config,
)
from lowcomm_jax.train import Trainer


def test_fragment_patterns_cover_every_parameter_once():
  params, _, _ = layered_problem(layers=6)
  strided = frag_lib.layer_fragments(params, 3, "strided")
  assert [f.name for f in strided] == ["blocks strided 0", "blocks strided 1", "blocks strided 2",
                                       "non-block"]
  assert dict(strided[1].leaves)["blocks/w"] == (1, 6, 3)  # layers 1 and 4
  by_path = lambda f: frag_lib.flatten(frag_lib.extract(f, params))  # the fragment's sub-tree
  np.testing.assert_array_equal(by_path(strided[1])["blocks/w"],
                                params["blocks"]["w"][np.array([1, 4])])
  sequential = frag_lib.layer_fragments(params, 3, "sequential", non_block="fold")
  assert len(sequential) == 3 and ("head", None) in sequential[0].leaves
  np.testing.assert_array_equal(by_path(sequential[2])["blocks/w"], params["blocks"]["w"][4:6])
  for frags in (strided, sequential):
    frag_lib.check_cover(frags, params)
    rebuilt = params
    for f in frags:
      rebuilt = frag_lib.insert(f, rebuilt,
                                jax.tree.map(lambda v: v + 1, frag_lib.extract(f, params)))
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(params)):
      np.testing.assert_array_equal(a, b + 1)
  with pytest.raises(ValueError, match=r"uncovered: \['head'\]"):
    frag_lib.check_cover(strided[:3], params)


def test_schedule_is_staggered_data():
  s = schedule_lib.make_schedule(num_fragments=4, sync_every=8, overlap_steps=1, merge_alpha=0.5)
  np.testing.assert_array_equal(s.offset, [2, 4, 6, 8])
  # Fragment 0 is taken after step 2: sent in step 3's program, applied at its end (τ = 1).
  assert schedule_lib.phase_at(s, 3) == schedule_lib.Phase(send=(0,), receive=(0,))
  assert schedule_lib.phase_at(s, 2) == schedule_lib.Phase()
  assert schedule_lib.phase_at(s, 11) == schedule_lib.Phase(send=(0,), receive=(0,))
  phases, table, s0 = schedule_lib.phase_table(s)
  for step in range(1, 40):  # the periodic table gives every step's phase
    index = step if step < s0 else s0 + (step - s0) % 8
    assert phases[table[index - 1]] == schedule_lib.phase_at(s, step)
  assert len(phases) == 5  # nothing, and one program per fragment


def test_unstaggered_fragments_equal_diloco_for_an_elementwise_outer_optimizer():
  params, xs, loss_fn = layered_problem()
  inner, outer = optax.adam(0.03), lowcomm_jax.outer_nesterov(0.7, 0.9)
  a, sa = run_replicas(lowcomm_jax.diloco(inner, outer, sync_every=4), params, xs, loss_fn)
  tx = lowcomm_jax.streaming_diloco(inner, outer, sync_every=4, fragments=2, staggered=False)
  b, sb = run_replicas(tx, params, xs, loss_fn)
  # The same elementwise arithmetic, split in two fragments, compiled apart (fusion may round an
  # intermediate otherwise): per outer step the mean of 3 replicas and ≤ 8 roundings, 3 outer steps.
  testing.assert_trees_within((b, sb.outer_params), (a, sa.outer_params),
                              testing.trajectory_error_bound((a, sa.outer_params), 3, 3 + 8))


def test_two_fragments_tau1_alpha_half_by_hand():
  # Two one-parameter layers w = (a, b); fragment 0 = layer 0, fragment 1 = layer 1. M = 2, H = 4,
  # P = 2 (offsets 2 and 4), τ = 1, α = ½, outer SGD lr 1. loss_m = ½‖w − y_m‖², inner SGD lr ½:
  # w ← ½w + ½y_m, with y_0 = (2, 0), y_1 = (0, 4), w₀ = φ₀ = 0.
  # a: after step 2 replica 0 has 1.5, replica 1 has 0: step 3 sends mean Δ = −0.75 from the
  #   parameters entering it, trains (1.75 and 0), then applies: φ_a = 0.75 and the replicas merge
  #   to ½·1.75 + ½·0.75 = 1.25 and ½·0 + ½·0.75 = 0.375. Steps 4–6: 1.625, 1.8125, 1.90625 and
  #   0.1875, 0.09375, 0.046875.
  # b: replica 0 stays 0; replica 1 reaches 2, 3, 3.5, 3.75 by step 4; step 5 sends mean Δ = −1.875,
  #   trains (0 and 3.875), applies φ_b = 1.875 and merges to 0.9375 and 2.875; step 6: 0.46875,
  #   3.4375.
  targets = jnp.broadcast_to(jnp.array([[2.0, 0.0], [0.0, 4.0]]), (6, 2, 2))
  params = {"blocks": {"w": jnp.zeros(2)}}
  loss_fn = lambda p, y: 0.5 * jnp.sum((p["blocks"]["w"] - y) ** 2)
  tx = lowcomm_jax.streaming_diloco(optax.sgd(0.5), optax.sgd(1.0), sync_every=4, fragments=2,
                                    overlap_steps=1, merge_alpha=0.5, non_block_fragment="fold")
  params_r, state = run_replicas(tx, params, targets, loss_fn, use_phase=True)
  # Every value above and every rate (½, 1) is a short binary fraction: float32 holds them exactly.
  np.testing.assert_array_equal(state.outer_params["blocks"]["w"], [0.75, 1.875])
  np.testing.assert_array_equal(params_r["blocks"]["w"], [[1.90625, 0.46875], [0.046875, 3.4375]])
  traced_r, traced_state = run_replicas(tx, params, targets, loss_fn, use_phase=False)
  np.testing.assert_array_equal(traced_r["blocks"]["w"], params_r["blocks"]["w"])


def test_hlo_overlap_and_only_the_due_fragment_moves(tmp_path):
  c = streaming_config(num_replicas=8, **{"mesh.replica": 8, "mesh.data": 1})
  trainer = Trainer(c, tmp_path)
  state = trainer.init_state()
  params = jax.tree.map(lambda x: x[0], state.params)
  frags = trainer.algorithm.tx.fragments(params)
  # tiny: 2 layers -> fragments: layer 0, layer 1, non-block (embedding, final norm, head); offsets
  # 2, 4, 6.
  sizes = [f.num_elements(params) for f in frags]
  assert sum(sizes) == trainer.num_params
  quiet, _ = trainer.program(trainer.algorithm.phase_at(2), state)
  assert not hlo.collectives(quiet.as_text())
  peak = 0.0
  for p, step in enumerate((3, 5, 7)):
    phase = trainer.algorithm.phase_at(step)
    assert phase == schedule_lib.Phase(send=(p,), receive=(p,))
    program, entries = trainer.program(phase, state)
    assert [e.name for e in entries] == [f"fragment {p}"]
    assert entries[0].payload_bytes == 4 * sizes[p]  # only fragment p, in float32
    assert entries[0].sent_bytes == pytest.approx(comm.ring_factor(8) * 4 * sizes[p])
    text = program.as_text()
    assert hlo.collectives(text)
    # The overlapped all-reduce reads the parameters entering the step: no matmul or layer loop
    # (forward/backward) upstream of it, so XLA is free to run it under the compute.
    assert not any(hlo.collective_depends_on_compute(text))
    peak = max(peak, entries[0].sent_bytes)
  # With τ = 0 the outer gradient is taken after this step's update: the collective waits for it.
  blocking = Trainer(streaming_config(num_replicas=8, **{"mesh.replica": 8, "mesh.data": 1,
                                                          "outer.overlap_steps": 0}),
                     tmp_path / "b")
  program, _ = blocking.program(blocking.algorithm.phase_at(2), blocking.init_state())
  assert all(hlo.collective_depends_on_compute(program.as_text()))
  assert peak == pytest.approx(comm.ring_factor(8) * 4 * max(sizes))


def test_run_reports_peak_bytes_about_one_over_p_of_diloco(tmp_path):
  trainer = Trainer(streaming_config(num_steps=12, **{"outer.overlap_steps": 0}), tmp_path / "s")
  s = trainer.run()["bytes_sent_per_worker"]
  # DiLoCo over the same 12 steps with H = 6, by hand: a float32 ring all-reduce of every parameter
  # (2(M − 1)/M of it sent by each of M = 2 workers) at steps 6 and 12
  diloco_per_sync = 4 * trainer.num_params * comm.ring_factor(2)
  assert s["total"] == pytest.approx(2 * diloco_per_sync, rel=1e-9)  # every parameter once per H
  assert s["peak_per_sync"] < 0.6 * diloco_per_sync


def test_resume_with_a_fragment_in_flight_is_bit_identical(tmp_path):
  # H = 12, 3 fragments, τ = 2: fragment 0 is sent in step 5's program and applied after step 6.
  c = streaming_config(num_steps=12, **{"outer.sync_every": 12, "outer.overlap_steps": 2,
                                        "checkpoint.every": 4})
  full = Trainer(c, tmp_path / "full")
  _, full_final = testing.run_to_end(full)
  first = streaming_config(num_steps=12, stop_at_step=5, **{"outer.sync_every": 12,
                                                            "outer.overlap_steps": 2,
                                                            "checkpoint.every": 5})
  Trainer(first, tmp_path / "r").run()
  resumed = Trainer(c, tmp_path / "r")
  assert resumed.algorithm.phase_at(5).send == (0,) and resumed.algorithm.phase_at(6).receive == (
    0,
  )
  _, resumed_final = testing.run_to_end(resumed)
  for a, b in zip(jax.tree.leaves(full_final.state), jax.tree.leaves(resumed_final.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert [m["loss"] for m in read_metrics(tmp_path / "full")] == [
    m["loss"] for m in read_metrics(tmp_path / "r")
  ]


@pytest.mark.parametrize("changes,message", [
    ({"outer.sync_every": 7},
     r"outer.sync_every \(H=7\) must be divisible by the number of fragments \(P=3"),
    ({"outer.overlap_steps": 2},
     r"outer.overlap_steps \(τ=2\) must be >= 0 and smaller than H/P = 2"),
    ({"outer.merge_alpha": 1.5}, r"outer.merge_alpha \(α\) must be in \[0, 1\]"),
    ({"outer.num_fragments": 3, "outer.sync_every": 8},
     r"outer.num_fragments=3 must divide the model's 2 layers"),
    ({"outer.codec": "fp5"}, r"outer.codec must be none or one of"),
])
def test_bad_input_is_named_before_compute(tmp_path, changes, message):
  with pytest.raises(ValueError, match=message):
    Trainer(streaming_config(**changes), tmp_path / "w")
  assert not (tmp_path / "w").exists()


def test_a_fragment_rule_that_misses_parameters_is_refused():
  params, xs, loss_fn = layered_problem()
  partial = lambda p: frag_lib.layer_fragments(p, 2, non_block="fold")[1:]
  tx = lowcomm_jax.optim.StreamingDiLoCo(optax.sgd(0.1), optax.sgd(1.0),
                                         schedule_lib.make_schedule(1, 4), partial)
  with pytest.raises(ValueError, match=r"uncovered: \['blocks/b', 'blocks/w', 'head'\]"):
    tx.init(params)


def test_e3m0_codec_sends_about_an_eighth_of_the_bits(tmp_path):
  from lowcomm_jax import codecs  # pylint: disable=g-import-not-at-top
  c = streaming_config(num_steps=6, **{"outer.overlap_steps": 0, "outer.codec": "e3m0"})
  trainer = Trainer(c, tmp_path)
  summary, trainer_final = testing.run_to_end(trainer)
  params = jax.tree.map(lambda x: x[0], trainer_final.state.params)
  codec = codecs.get_codec("e3m0", block_size=1024)
  expected = sum(comm.compressed_mean_wire_bytes(frag_lib.extract(f, params), codec, 2)
                 for f in trainer.algorithm.tx.fragments(params))  # each fragment once in 6 steps
  sent = summary["bytes_sent_per_worker"]
  assert sent["total"] == expected
  # a float32 ring all-reduce of everything once per 6 steps
  fp32_bits = 32 * comm.ring_factor(2) / 6
  assert 0.12 < sent["bits_per_param_per_step"] / fp32_bits < 0.135


def test_nonfinite_outer_gradient_never_reaches_the_global_params(tmp_path):
  params, xs, loss_fn = layered_problem(replicas=2, steps=4)
  poisoned = xs.at[1, 1].set(jnp.nan)  # replica 1's second batch
  tx = lowcomm_jax.streaming_diloco(optax.sgd(0.1), lowcomm_jax.outer_nesterov(), sync_every=2)
  params_r, state = run_replicas(tx, params, poisoned[:2], loss_fn)  # one round, refused
  assert int(state.nonfinite[0]) == 1
  for g in jax.tree.leaves(state.outer_params):
    assert np.isfinite(g).all()
  # The refused round restarts every replica from φ, which still holds the initial parameters.
  for g, p, r in zip(jax.tree.leaves(state.outer_params), jax.tree.leaves(params),
                     jax.tree.leaves(params_r)):
    np.testing.assert_array_equal(g, p)
    # θ + (φ − θ): two roundings of values within twice the leaf's scale
    testing.assert_within(r, np.broadcast_to(p, r.shape),
                          testing.operation_error_bound(2 * np.max(np.abs(np.asarray(p))), 2))
  _, state = run_replicas(tx, params, poisoned, loss_fn)  # the next round is clean and applied
  assert int(state.nonfinite[0]) == 1
  assert any(not np.array_equal(g, p) for g,
             p in zip(jax.tree.leaves(state.outer_params), jax.tree.leaves(params)))
  c = streaming_config(num_steps=6, **{"optimizer.learning_rate": 1e30, "optimizer.grad_clip": 0.0,
                                       "outer.overlap_steps": 0})
  with pytest.raises(lowcomm_jax.codecs.NonFiniteError,
                     match=r"by step \d+: the averaged outer gradient of "
                     r"fragment \d \(blocks strided \d\) held NaN or inf"):
    Trainer(c, tmp_path / "raise").run()


def test_regex_fragment_table():
  params, xs, loss_fn = layered_problem(replicas=2, steps=4)
  rules = [(r"blocks/w", 0), (r"blocks/.*", 1), (r".*", 2)]
  frags = frag_lib.rule_fragments(params, rules)
  assert [dict(f.leaves) for f in frags] == [{"blocks/w": None}, {"blocks/b": None}, {"head": None}]
  tx = lowcomm_jax.optim.StreamingDiLoCo(optax.sgd(0.1), optax.sgd(1.0),
                                         schedule_lib.make_schedule(3, 6),
                                         lambda p: frag_lib.rule_fragments(p, rules))
  run_replicas(tx, params, xs, loss_fn)
  with pytest.raises(ValueError,
                     match=r"outer.fragment_rules: the rules \['emb.*'\] match no parameter"):
    frag_lib.rule_fragments(params, [("emb.*", 0), (".*", 1)])
  with pytest.raises(ValueError,
                     match=r"outer.fragment_rules must cover every parameter, these match no "
                           r"rule: \['head'\]"):
    frag_lib.rule_fragments(params, [("blocks/.*", 0)])
