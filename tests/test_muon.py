"""optimizer.name=muon: optax's Muon on the layer blocks' weight matrices, AdamW on the rest, as the
inner optimizer of every algorithm (MuLoCo: Muon inside DiLoCo)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax import contrib

import lowcomm_jax
from lowcomm_jax import config as config_lib
from lowcomm_jax.models import config as model_config, llama
from lowcomm_jax.optim import inner
from lowcomm_jax.testing import read_metrics, tiny_config
from lowcomm_jax.train import Trainer

EPS32 = float(np.finfo(np.float32).eps)
NS_STEPS = 5  # optax's default Newton–Schulz iterations


def _muon_options(**changes):
  opt = config_lib.default_config().optimizer
  opt.update(dict(name="muon", grad_clip=0.0, warmup_steps=0, learning_rate=0.01, **changes))
  return opt


def _tiny_shapes():
  """The tiny decoder's parameter tree, shapes only."""
  model = nnx.eval_shape(lambda: llama.Decoder(model_config.get_model_config("tiny"), nnx.Rngs(0)))
  return nnx.split(model, nnx.Param)[1].to_pure_dict()


def _normal(tree, seed: int, scale: float = 1.0):
  """float32 normal values in the shapes of `tree`."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(scale * rng.standard_normal(x.shape), jnp.float32),
                      tree)


def _run(tx, params, grads_list):
  """The updates of `tx` on the successive gradients (applied as they come)."""
  state, updates, update = tx.init(params), [], jax.jit(tx.update)
  for grads in grads_list:
    u, state = update(grads, state, params)
    updates.append(u)
    params = optax.apply_updates(params, u)
  return updates


def _bound(reference, sum_length):
  """float32 difference two orderings of the same arithmetic may show: each Newton–Schulz iteration
  runs three chained matmuls of `sum_length` terms on a matrix of spectral norm <= 1, each term's
  rounding at most ε of the largest entry of the result."""
  return NS_STEPS * 3 * sum_length * EPS32 * float(jnp.abs(reference).max())


def test_each_block_matrix_steps_as_optax_muon_on_that_matrix_and_the_rest_as_adamw():
  """A stacked weight [L, ...] is L matrices, each orthogonalized on its own; an attention weight
  [L, d, heads, head_dim] is one d × (heads · head_dim) matrix per layer. The embeddings, the head
  and the norm scales take AdamW's step (the fallback of optax's muon: Nesterov, ε = 1e-8)."""
  params = _normal(_tiny_shapes(), seed=0, scale=0.1)
  grads = [_normal(params, seed=1 + k) for k in range(2)]
  opt = _muon_options()
  ours = _run(inner.make_optimizer(opt, 10), params, grads)
  lr = inner.learning_rate_schedule(opt, 10)
  muon = contrib.muon(lr, beta=opt.b1, weight_decay=opt.weight_decay,
                      # its default: every 2-D leaf is Muon's
                      consistent_rms=inner.MUON_CONSISTENT_RMS)
  d, ff = params["blocks"]["mlp"]["w_up"].shape[1:]
  # rows: the reduction side of x @ W (d_model in, or heads · head_dim = d_model, or d_ff)
  for section, name, layer, rows in (("attn", "wq", 1, d), ("attn", "wo", 0, d),
                                     ("mlp", "w_down", 1, ff)):
    matrix = lambda t, n=name, s=section: t["blocks"][s][n][layer].reshape(rows, -1)
    expected = _run(muon, matrix(params), [matrix(g) for g in grads])
    for step in range(2):
      got = matrix(ours[step])
      np.testing.assert_allclose(got, expected[step], rtol=0,
                                 atol=_bound(expected[step], max(got.shape)),
                                 err_msg=f"{name} {step}")
  adamw = optax.adamw(lr, b1=opt.b1, b2=opt.b2, eps=1e-8, weight_decay=opt.weight_decay,
                      nesterov=True)
  for path in (("embed",), ("blocks", "mlp_norm", "scale")):
    take = lambda t, p=path: t[p[0]] if len(p) == 1 else t[p[0]][p[1]][p[2]]
    expected = _run(adamw, take(params), [take(g) for g in grads])
    for step in range(2):  # elementwise: a few roundings of the step's size
      np.testing.assert_allclose(take(ours[step]), expected[step], rtol=0,
                                 atol=16 * EPS32 * float(jnp.abs(expected[step]).max()))


def test_in_diloco_each_replica_steps_its_matrices_by_muon_until_the_sync():
  """`lowcomm_jax.diloco` with the config's Muon as its inner optimizer, 2 simulated replicas:
  before the first sync each replica's step on a block matrix is optax's muon on that replica's
  gradient."""
  params = _normal(_tiny_shapes(), seed=0, scale=0.1)
  opt = _muon_options()
  tx = lowcomm_jax.diloco(inner.make_optimizer(opt, 10), sync_every=3)
  grads_r = [
    _normal(jax.tree.map(lambda x: np.stack([x, x]), params), seed=3 + k) for k in range(2)
  ]

  def step(p, state, g):
    u, state = tx.update(g, state, p)
    return optax.apply_updates(p, u), state, u

  step_r = jax.jit(jax.vmap(step, in_axes=(0, tx.state_axes, 0), out_axes=(0, tx.state_axes, 0),
                            axis_name="replica"))
  params_r, state = tx.init_replicated(params, num_replicas=2)
  updates = []
  for g in grads_r:
    params_r, state, u = step_r(params_r, state, g)
    updates.append(u)
  muon = contrib.muon(inner.learning_rate_schedule(opt, 10), beta=opt.b1,
                      weight_decay=opt.weight_decay, consistent_rms=inner.MUON_CONSISTENT_RMS)
  for replica in range(2):
    matrix = lambda t, r=replica: t["blocks"]["mlp"]["w_gate"][r, 1]
    expected = _run(muon, params["blocks"]["mlp"]["w_gate"][1], [matrix(g) for g in grads_r])
    for step_index in range(2):
      got = matrix(updates[step_index])
      np.testing.assert_allclose(got, expected[step_index], rtol=0,
                                 atol=_bound(expected[step_index], max(got.shape)))


@pytest.mark.trainer  # a Trainer run: not in the fast tier
def test_muon_trains_the_tiny_model_as_diloco_inner_optimizer(tmp_path):
  c = tiny_config(**{"algorithm": "diloco", "num_replicas": 2, "outer.sync_every": 5,
                     "num_steps": 10, "optimizer.name": "muon", "optimizer.warmup_steps": 2,
                     "optimizer.learning_rate": 0.01})
  Trainer(c, tmp_path / "run").run()
  losses = [np.mean(m["loss"]) if isinstance(m["loss"], list) else m["loss"]
            for m in read_metrics(tmp_path / "run") if "loss" in m]
  # ln 256 = 5.55 nats at the start (bytes); real text under Muon falls well below it.
  assert losses[0] > 5.0 and np.mean(losses[-3:]) < losses[0] - 0.8, losses
