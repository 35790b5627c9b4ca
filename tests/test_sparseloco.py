"""SparseLoCo (lowcomm_jax.sparseloco): Streaming DiLoCo whose fragments travel as a sparse gather.

The compression and the exchange are tested against a numpy oracle in test_sparseloco_compression;
here: the outer step built on them (error feedback with decay β replaces the outer momentum), the
thread executor equal to inline, and the run's bytes equal to the sparse payloads sent. The engine
battery (tests/test_engine.py, case `sparseloco`) covers golden metrics, resume mid-round, one
device = the mesh and ledger bytes = the compiled collectives.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowcomm_jax
from lowcomm_jax import comm, testing
from lowcomm_jax.codecs.topk import TopKCompressor
from lowcomm_jax.comm.sparse_mean import sparse_mean_wire_bytes
from lowcomm_jax.optim import fragments as frag_lib
from lowcomm_jax.train import Trainer, hooks

M, H, LR, BETA, ETA = 3, 2, 0.1, 0.5, 0.8


def test_two_outer_steps_follow_the_papers_update():
  """Inner SGD on a loss whose gradient is the replica's x_m, so θ_m after H steps is θ − H·lr·x_m.
  Then, per outer step: e_m ← β·e_m + Δ_m; φ ← φ − η·sparse_mean(e_m); e_m keeps what its payload
  dropped; θ_m ← φ (α = 0)."""
  params = {"w": jnp.linspace(-1.0, 1.0, 40).reshape(5, 8), "b": jnp.arange(6.0) / 7}
  xs = jax.random.normal(jax.random.key(1), (M,) + (46,))
  unflat = lambda x: {"w": x[:40].reshape(5, 8), "b": x[40:]}
  compressor = TopKCompressor(chunk_size=16, top_k=3, bits=2)
  tx = lowcomm_jax.sparseloco(optax.sgd(LR), sync_every=H, chunk_size=16, top_k=3, bits=2,
                              feedback_decay=BETA, outer_learning_rate=ETA)
  loss = lambda p, x: jnp.vdot(jnp.concatenate([p["w"].reshape(-1), p["b"]]), x)

  def step(p, s, x):
    updates, s = tx.update(jax.grad(loss)(p, x), s, p)
    return optax.apply_updates(p, updates), s

  run = jax.jit(jax.vmap(step, in_axes=(0, tx.state_axes, 0), out_axes=(0, tx.state_axes),
                         axis_name="replica"))
  params_r, state = tx.init_replicated(params, M)
  # the oracle: the same algebra with the exchange as comm.sparse_mean (its own numpy oracle)
  exchange = jax.jit(jax.vmap(lambda e: comm.sparse_mean(e, "replica", compressor, residual=e,
                                                         decay=0.0), axis_name="replica"))
  phi, errors = params, jax.tree.map(lambda x: jnp.zeros((M,) + x.shape), params)
  for _ in range(2):
    for _ in range(H):
      params_r, state = run(params_r, state, xs)
    local = jax.vmap(lambda x: jax.tree.map(lambda p, g: p - H * LR * g, phi, unflat(x)))(xs)
    delta = jax.tree.map(lambda f, l: f[None] - l, phi, local)
    errors = jax.tree.map(lambda e, d: BETA * e + d, errors, delta)
    mean, errors = exchange(errors)
    phi = jax.tree.map(lambda f, m: f - ETA * m[0], phi, mean)
  residuals = state.comm.residuals["fragment 0"]
  # Orders of the sums differ (the inner steps, β·e + Δ, 1/M): a few float32 roundings at the scale.
  bound = lambda x: testing.trajectory_error_bound(x, 2 * H, 4 + M)
  testing.assert_trees_within(state.outer_params, phi, bound, "φ")
  testing.assert_trees_within(residuals, errors, bound, "error buffers")
  testing.assert_trees_within(jax.tree.map(lambda x: x[0], params_r), phi, bound, "θ after merge")
  # Not vacuous: the buffers hold what was not sent, and φ moved by less than the dense mean would.
  assert all(float(jnp.abs(e).max()) > 0 for e in jax.tree.leaves(residuals))
  assert not np.allclose(np.asarray(phi["w"]), np.asarray(params["w"]))


def test_thread_equals_inline_and_the_bytes_are_the_sparse_payloads(tmp_path):
  runs = {}
  for mode in ("inline", "thread"):
    trainer = Trainer(testing.engine_config("sparseloco", **{"outer.overlap_executor": mode}),
                      tmp_path / mode, devices=jax.devices()[:1])
    final, timeline = hooks.FinalState(), hooks.CommTimeline()
    runs[mode] = (trainer, trainer.run(hooks=[final, timeline]), final, timeline)
  (inline, summary, inline_end, _), (threaded, threaded_summary, threaded_end, threaded_comm) = (
      runs["inline"], runs["thread"])
  assert (inline.overlap_executor, threaded.overlap_executor) == ("inline", "thread")
  assert [(i.step, i.name) for i in threaded_comm.issued] == [(3, "fragment 0"), (5, "fragment 1")]
  # 6 steps; the thread's separate merge program rounds at the ulp scale (as Streaming DiLoCo's)
  testing.assert_trees_within(threaded_end.state, inline_end.state, lambda x: (
      testing.trajectory_error_bound(x, 6, 8) if np.size(x) else 0), "state")
  # Each sync sends its fragment's payload to the M − 1 = 1 other replica: indices, codes, levels.
  params = jax.tree.map(lambda x: x[0], inline_end.state.params)
  frags = inline.algorithm.tx.fragments(params)
  compressor = TopKCompressor(64, 4, 2)
  payload = [sparse_mean_wire_bytes(frag_lib.extract(f, params), compressor) for f in frags]
  for s in (summary, threaded_summary):
    assert s["bytes_sent_per_worker"]["total"] == payload[0] + payload[1]
    assert s["bytes_sent_per_worker"]["peak_per_sync"] == max(payload)
  assert payload[0] + payload[1] < 4 * inline.num_params / 20  # a twentieth of one float32 sync
  # The virtual clock: each gather, issued from the parameters entering steps 3 and 5 (ready when
  # steps 2 and 4 end, clock steps 1 and 3), needed one step later; an all-gather of M payloads.
  events = inline.comm_events(6, inline_end.state)
  assert [(e.issued_step, e.consumed_step, e.kind, e.payload_bytes, e.num_workers)
          for e in events] == [(1, 3, "all_gather", 2 * payload[0], 2),
                               (3, 5, "all_gather", 2 * payload[1], 2)]



def test_the_outer_sections_fragment_rules_cut_its_fragments(tmp_path):
  """SparseLoCo reads the `outer` schedule as Streaming DiLoCo does, fragment rules included: one
  rule matching every parameter is the whole model, bit for bit."""
  finals = []
  for name, rules in (("whole", ""), ("one_rule", ".*:0")):
    config = testing.engine_config("sparseloco", **{"outer.num_fragments": 1,
                                                    "outer.fragment_rules": rules})
    trainer = Trainer(config, tmp_path / name, devices=jax.devices()[:1])
    final = hooks.FinalState()
    trainer.run(hooks=[final])
    finals.append((trainer.fragment_names, final.state))
  (whole_names, whole), (rule_names, one_rule) = finals
  assert (whole_names, rule_names) == (["all"], ["rule fragment 0"])
  assert jax.tree.structure(whole) == jax.tree.structure(one_rule)
  pairs = zip(jax.tree.leaves(whole), jax.tree.leaves(one_rule))
  assert all(np.array_equal(a, b) for a, b in pairs)
