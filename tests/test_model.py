"""The decoder: shapes, parameter count and FLOPs against hand counts, and the path forward."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowcomm_jax import models, testing
from lowcomm_jax.models import llama


@pytest.fixture(scope="module")
def tiny():
  cfg = models.get_model_config("tiny")
  return cfg, llama.Decoder(cfg, nnx.Rngs(0))


def test_tiny_parameter_count_by_hand(tiny):
  cfg, model = tiny
  # d=32, L=2, d_ff=64, V=256. Per block: norms 2·32 + q,k,v,o 4·32² + SwiGLU 3·32·64 = 10304.
  # Outside: embedding 256·32 + final norm 32 + head 32·256 = 16416.
  assert models.param_count(cfg) == 2 * 10304 + 16416 == 37024
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert sum(x.size for x in leaves) == 37024
  assert models.param_count(cfg, include_embedding=False) == 37024 - 256 * 32


def test_shapes_and_logical_axes(tiny):
  cfg, model = tiny
  logits = model(jnp.zeros((3, 17), jnp.int32))
  assert logits.shape == (3, 17, 256) and logits.dtype == jnp.float32
  axes = llama.logical_axes(model)
  assert axes["blocks/attn/wq"] == ("layers", "embed", "heads", "head_dim")
  assert axes["blocks/mlp/w_down"] == ("layers", "mlp", "embed")
  assert axes["embed"] == ("vocab", "embed")
  assert nnx.state(model, nnx.Param)["blocks"]["attn"]["wq"][...].shape == (2, 32, 2, 16)


def test_flops_formula_by_hand_and_against_xla():
  cfg = models.get_model_config("tiny")
  t = 128
  # Forward per token: 2·(4d² + 3·d·d_ff) = 2·(4096 + 6144) per block, 4·T·d = 16384 attention per
  # block, 2·d·V = 16384 for the head: 2·(20480 + 16384) + 16384 = 90112. Training: 3×.
  assert models.flops_per_token(cfg, t, training=False) == 90112
  assert models.flops_per_token(cfg, t) == 3 * 90112
  # XLA's cost analysis counts a scan body once, so compare on a one-block model:
  # 2·(4096 + 6144) + 16384 + 16384 = 53248 FLOPs per token.
  one_block = models.get_model_config("tiny", num_layers=1)
  assert models.flops_per_token(one_block, t, training=False) == 53248
  model = llama.Decoder(one_block, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
  cost = fwd.lower(params, jnp.zeros((2, t), jnp.int32)).compile().cost_analysis()
  xla_flops = cost["flops"] if isinstance(cost, dict) else cost[0]["flops"]
  # XLA also counts norms, softmax and rotary element-wise work, so it may exceed the matmul count
  # a little, never fall short of it.
  assert 1.0 <= xla_flops / (2 * t * 53248) < 1.15


def _decoder_bound(cfg, logits, seq_len):
  """float32 bound between two evaluations of the decoder's logits that sum in other orders."""
  return testing.sum_error_bound(np.max(np.abs(np.asarray(logits))),
                                 testing.chain_of_sums(cfg, seq_len))


def test_default_path_equals_plain_forward(tiny):
  cfg, model = tiny
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 256)
  plain = model(tokens)
  pathed = model(tokens, path=jnp.arange(cfg.num_layers))
  # The same blocks in the same order, compiled apart (a gathered layer vs a sliced one): sums may
  # be blocked otherwise, so within the decoder's chain of sums at the logits' scale.
  testing.assert_within(pathed, plain, _decoder_bound(cfg, plain, 24))


def test_swapped_path_equals_blocks_run_by_hand_in_that_order(tiny):
  cfg, _ = tiny
  model = llama.Decoder(cfg, nnx.Rngs(5))
  # Larger block weights than at init, so that the order of the blocks visibly matters.
  blocks_state = nnx.state(model.blocks)
  nnx.update(model.blocks, jax.tree.map(lambda a: 20 * a, blocks_state))
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 256)
  graphdef, blocks = nnx.split(model.blocks)
  cos, sin = llama.rotary_tables(16, cfg.head_dim, cfg.rope_base)
  x = jnp.take(model.embed[...], tokens, axis=0)
  for layer in (1, 0):
    x = nnx.merge(graphdef, jax.tree.map(lambda a, i=layer: a[i], blocks))(x, cos, sin)
  by_hand = model.final_norm(x) @ model.head[...]
  # The same blocks in that order, run op by op by hand: sums may be blocked otherwise.
  testing.assert_within(model(tokens, path=[1, 0]), by_hand, _decoder_bound(cfg, by_hand, 16))
  assert not np.allclose(model(tokens, path=[1, 0]), model(tokens), atol=1e-3)


def test_skipped_layer_gets_no_gradient(tiny):
  cfg, model = tiny
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, 256)
  loss = lambda p: nnx.merge(graphdef, p)(tokens, path=[1]).mean()
  grads = jax.grad(loss)(params)
  for leaf in jax.tree.leaves(grads["blocks"]):
    assert np.all(leaf[0] == 0)
    assert np.any(leaf[1] != 0) or leaf[1].size == 0


def _loss_and_grads(cfg, tokens, path=None):
  graphdef, params = nnx.split(llama.Decoder(cfg, nnx.Rngs(0)), nnx.Param)
  loss = lambda p: nnx.merge(graphdef, p)(tokens, path=path).mean()
  return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unrolled_layers_equal_scanned_layers(dtype):
  tokens = jax.random.randint(jax.random.key(4), (2, 32), 0, 256)
  make = lambda loop: models.get_model_config("tiny", num_layers=3, dtype=dtype, layer_loop=loop)
  loss_scan, grads_scan = jax.jit(lambda t: _loss_and_grads(make("scan"), t))(tokens)
  loss_unroll, grads_unroll = jax.jit(lambda t: _loss_and_grads(make("unroll"), t))(tokens)
  # Same operations in the same order; only XLA's fusion choices may differ (an intermediate kept in
  # float32 or rounded to the compute dtype, a sum blocked otherwise). float32: each leaf within the
  # sum bound of its scale, each value through at most 6 chained sums of ≤ d_ff = 64 terms (3 blocks
  # forward and back). bfloat16: 2.5 of its ulps (2⁻⁸) of each leaf's scale, a relative bound
  # independent of the CPU; a wrong layer order or dtype differs by whole units.
  if dtype == "float32":
    bound = lambda b: testing.sum_error_bound(np.max(np.abs(b)), 6 * 64)
  else:
    bound = lambda b: 1e-2 * np.max(np.abs(np.asarray(b, np.float32)))
  testing.assert_within(loss_unroll, loss_scan, bound(loss_scan), "loss")
  jax.tree.map(lambda a,
               b: testing.assert_within(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                  bound(np.asarray(b, np.float32))),
               grads_unroll, grads_scan)


def test_layer_loop_choice_and_bad_value():
  cfg = models.get_model_config("small")
  assert cfg.unrolls_layers("cpu") and not cfg.unrolls_layers("tpu")
  assert not models.get_model_config("small", num_layers=13).unrolls_layers("cpu")
  assert models.get_model_config("small", layer_loop="unroll").unrolls_layers("tpu")
  assert not models.get_model_config("small", layer_loop="scan").unrolls_layers("cpu")
  with pytest.raises(ValueError,
                     match=r"model.layer_loop must be one of \('auto', 'scan', 'unroll'\)"):
    models.get_model_config("small", layer_loop="unrolled")


def test_rotary_tables_are_constants_of_the_compiled_step():
  # Traced, the tables' cos and sin were fused into every rotary fusion and evaluated per element
  # of q and k; computed at trace time they are constants, and the step has no cosine or sine.
  cfg = models.get_model_config("tiny")
  graphdef, params = nnx.split(llama.Decoder(cfg, nnx.Rngs(0)), nnx.Param)
  tokens = jnp.zeros((2, 24), jnp.int32)
  step = jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p)(tokens).mean()))
  hlo = step.lower(params).compile().as_text()
  assert " cosine(" not in hlo and " sine(" not in hlo
  cos, sin = jax.jit(lambda: llama.rotary_tables(24, cfg.head_dim, cfg.rope_base))()
  positions, pairs = np.arange(24)[:, None], np.arange(0, cfg.head_dim, 2)[None, :]
  angles = positions / cfg.rope_base ** (pairs / cfg.head_dim)  # float64 reference
  # float32 angles: a power, a division and a product, each within u of its value (≤ 3u·|angle| of
  # absolute error, passed on by cos and sin at slope ≤ 1), then cos/sin's own few ulps of 1.
  bound = testing.operation_error_bound(angles, 3) + testing.operation_error_bound(1.0, 4)
  testing.assert_within(cos, np.cos(angles), bound, "cos")
  testing.assert_within(sin, np.sin(angles), bound, "sin")


def _swiglu_separate_matmuls(mlp, x):
  """The SwiGLU as written before gate and up shared a matmul: the reference formula."""
  gate = jax.nn.silu(x @ mlp.w_gate[...])
  return (gate * (x @ mlp.w_up[...])) @ mlp.w_down[...]


def test_swiglu_with_one_gate_up_matmul_equals_separate_matmuls():
  cfg = models.get_model_config("tiny")
  mlp = llama.SwiGLU(cfg, nnx.Rngs(3))
  graphdef, params = nnx.split(mlp, nnx.Param)
  x = jax.random.normal(jax.random.key(5), (2, 16, cfg.d_model))
  d_out = jax.random.normal(jax.random.key(6), (2, 16, cfg.d_model))
  def vjp_of(forward):
    out, vjp = jax.vjp(lambda p, x: forward(nnx.merge(graphdef, p), x), params, x)
    return out, vjp(d_out)
  out_new, grads_new = vjp_of(lambda m, x: m(x))
  out_old, grads_old = vjp_of(_swiglu_separate_matmuls)
  # The same products summed in other blockings: every value goes through a sum over d = 32 and one
  # over d_ff = 64 (forward or back), so within the sum bound of 96 terms of its leaf's scale.
  for a, b in zip(jax.tree.leaves((out_new, grads_new)), jax.tree.leaves((out_old, grads_old))):
    testing.assert_within(a, b, testing.sum_error_bound(np.max(np.abs(np.asarray(b))), 32 + 64))
