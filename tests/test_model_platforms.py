"""The model off CPU: dot_product attention, rematerialisation, one program on every platform,
presets."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowcomm_jax import config as config_lib, models
from lowcomm_jax.models import attention, llama
from lowcomm_jax.testing import attention_error_bound, read_metrics, tiny_config
from lowcomm_jax.train import Trainer

_EPS = float(jnp.finfo(jnp.float32).eps)


def test_dot_product_attention_equals_the_xla_attention_with_gradients():
  b, t, h, k = 2, 24, 3, 16
  q, kk, v, w = (
    jax.random.normal(key, (b, t, h, k)) for key in jax.random.split(jax.random.key(0), 4)
  )
  bhtk = lambda f: lambda q, k, v: jnp.swapaxes(f(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v))), 1,
                                                2)
  loss = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))
  out_xla, out_dp = (
    bhtk(llama.causal_attention)(q, kk, v),
    attention.dot_product_attention(q, kk, v),
  )
  np.testing.assert_allclose(out_dp, out_xla, rtol=0, atol=attention_error_bound(q, kk, t, out_xla))
  (_, grads_xla), (_, grads_dp) = (
    loss(bhtk(llama.causal_attention))(q, kk, v),
    loss(attention.dot_product_attention)(q, kk, v),
  )
  for name, g_dp, g_xla in zip("qkv", grads_dp, grads_xla):
    # the backward sums S (dV, dK) or S then K (dQ) more products of these magnitudes
    np.testing.assert_allclose(g_dp, g_xla, rtol=0, err_msg=name,
                               atol=attention_error_bound(q, kk, t, g_xla) * t)


def test_tpu_flash_attention_equals_the_xla_attention_with_gradients():
  """jax's Pallas TPU flash attention, as `dot_product_attention` lowers it for tpu, run by the TPU
  interpreter: two 128-long blocks of queries and keys (the causal mask across and within
  blocks)."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  b, t, h, k = 1, 256, 1, 16
  q, kk, v, w = (
    jax.random.normal(key, (b, t, h, k)) for key in jax.random.split(jax.random.key(2), 4)
  )
  assert attention._tpu_flash_accepts(q, kk) and not attention._tpu_flash_accepts(
    q[:, :24], kk[:, :24]
  )  # pylint: disable=protected-access
  loss = lambda f: jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))
  with pltpu.force_tpu_interpret_mode():
    out_flash = attention.tpu_flash_attention(q, kk, v)
    _, grads_flash = loss(attention.tpu_flash_attention)(q, kk, v)
  xla = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
  out_xla = xla(q, kk, v)
  _, grads_xla = loss(xla)(q, kk, v)
  np.testing.assert_allclose(out_flash, out_xla, rtol=0,
                             atol=attention_error_bound(q, kk, t, out_xla))
  for name, g_flash, g_xla in zip("qkv", grads_flash, grads_xla):
    np.testing.assert_allclose(g_flash, g_xla, rtol=0, err_msg=name,
                               atol=attention_error_bound(q, kk, t, g_xla) * t)


def test_tpu_flash_attention_runs_on_each_devices_rows():
  """Lowered for tpu on a (data 2, tensor 2) mesh, the Mosaic kernel takes one device's shard of the
  operands [B/2, H/2, T, K] (heads first): the batch split over `data` and the heads over `tensor`,
  not gathered onto every device; a sequence of 16 keeps XLA's attention (no kernel)."""
  from lowcomm_jax import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2),
                           (mesh_lib.DATA, mesh_lib.TENSOR))
  for t, kernels in ((128, 3), (16, 0)):
    operand = jax.ShapeDtypeStruct((4, t, 4, 16), jnp.float32)
    with mesh_lib.tracing(mesh):
      text = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention.dot_product_attention(q, k, v)),
                              argnums=(0, 1, 2))).trace(operand, operand, operand).lower(
                                  lowering_platforms=("tpu",)).as_text()
    calls = [line for line in text.splitlines() if "@tpu_custom_call(" in line]
    assert len(calls) == kernels, (t, len(calls))  # forward, dK/dV, dQ
    for call in calls:
      assert re.search(r"\(tensor<2x2x128x16xf32>", call), call[-200:]


@pytest.mark.parametrize("shared_keys", [False, True], ids=["own operands", "shared keys"])
def test_tpu_flash_attention_inside_a_replica_shard_map_keeps_each_replicas_gradients(shared_keys):
  """The Trainer's one replica per `replica` slice (a shard_map manual over `replica`, data and
  tensor automatic inside): `dot_product_attention` traces (its TPU branch typed varying over
  `replica` as the XLA branch is) and, lowered for tpu, its gradients stay on each replica's
  devices: the kernels take one device's rows, and no collective runs where every operand is the
  replica's own. Keys shared by the replicas get their gradients summed over `replica` (one
  all-reduce)."""
  from lowcomm_jax import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2),
                           (mesh_lib.REPLICA, mesh_lib.DATA, mesh_lib.TENSOR))
  own, lead = jax.sharding.PartitionSpec(mesh_lib.REPLICA), jax.sharding.PartitionSpec()
  key_spec = lead if shared_keys else own
  operand = jax.ShapeDtypeStruct((2, 4, 128, 4, 16), jnp.float32)  # [R, B, T, H, K]
  keys = jax.ShapeDtypeStruct(operand.shape[1:], jnp.float32) if shared_keys else operand

  def per_replica(q, k, v, w):
    mine = lambda x: x[0]
    k = k if shared_keys else mine(k)
    loss = lambda q, k, v: jnp.sum(attention.dot_product_attention(q, k, v) * mine(w))
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(mine(q), k, mine(v))
    return dq[None], dk if shared_keys else dk[None], dv[None]

  step = jax.shard_map(per_replica, mesh=mesh, in_specs=(own, key_spec, own, own),
                       out_specs=(own, key_spec, own), axis_names={mesh_lib.REPLICA})
  with mesh_lib.tracing(mesh):
    text = jax.jit(step).trace(operand, keys, operand, operand).lower(
        lowering_platforms=("tpu",)).as_text()
  calls = [line for line in text.splitlines() if "@tpu_custom_call(" in line]
  assert len(calls) == 3  # forward, dK/dV, dQ
  for call in calls:
    assert re.search(r"\(tensor<2x2x128x16xf32>", call), call[-200:]
  assert text.count("stablehlo.all_reduce") == (1 if shared_keys else 0)
  assert "all_gather" not in text and "collective_permute" not in text


_CFG = models.get_model_config("tiny", num_layers=4, d_model=64, num_heads=2, d_ff=128,
                               layer_loop="scan")
_TOKENS = jax.random.randint(jax.random.key(1), (4, 128), 0, _CFG.vocab_size)


def _grad_program(cfg, tokens=_TOKENS):
  """jit(grad(a loss of the decoder's logits)), traced for the parameters' and tokens' shapes."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: llama.Decoder(cfg, nnx.Rngs(0))))
  params = jax.eval_shape(lambda: llama.init_params(cfg, 0))

  def loss(params, tokens):
    return jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens))[..., 0])
  return jax.jit(jax.value_and_grad(loss)).trace(params,
                                                 jax.ShapeDtypeStruct(tokens.shape, tokens.dtype))


@functools.cache
def _compiled_and_values(cfg):
  compiled = _grad_program(cfg).lower().compile()
  return compiled, compiled(
    llama.init_params(dataclasses.replace(cfg, remat="none", attention="xla"), 0), _TOKENS
  )


def _assert_same_gradients(values, reference, what):
  # Recomputation repeats the same ops (fusion may round differently); dot_product sums in another
  # order. Relative to each leaf's largest entry: a few ε per sum of d_model = 64 or T = 128 terms,
  # through 4 layers.
  (loss, grads), (loss0, grads0) = values, reference
  np.testing.assert_allclose(loss, loss0, rtol=64 * _EPS, err_msg=what)
  for (path, g), g0 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads0)):
    np.testing.assert_allclose(g, g0, rtol=0, atol=512 * _EPS * float(jnp.max(jnp.abs(g0))),
                               err_msg=f"{what} {llama.path_name(path)}")


def test_remat_keeps_the_gradients_and_lowers_the_compiled_temporaries():
  compiled_none, reference = _compiled_and_values(_CFG)
  temp = {"none": compiled_none.memory_analysis().temp_size_in_bytes}
  for remat in ("full", "dots"):
    compiled, values = _compiled_and_values(dataclasses.replace(_CFG, remat=remat))
    _assert_same_gradients(values, reference, remat)
    temp[remat] = compiled.memory_analysis().temp_size_in_bytes
  # Without remat each layer but the last keeps at least its [B, H, T, T] probabilities and its
  # [B, T, 2, F] gate‖up (float32) for the backward; "full" keeps neither, "dots" not the
  # probabilities.
  b, t = _TOKENS.shape
  probs, gate_up = 4 * b * _CFG.num_heads * t * t, 4 * b * t * 2 * _CFG.d_ff
  layers = _CFG.num_layers - 1
  assert temp["full"] + layers * (probs + gate_up) <= temp["none"], temp
  assert temp["dots"] + layers * probs <= temp["none"], temp


def test_dot_product_and_unrolled_remat_keep_the_gradients():
  _, reference = _compiled_and_values(_CFG)
  for changes in ({"attention": "dot_product"}, {"layer_loop": "unroll", "remat": "dots"}):
    _assert_same_gradients(_compiled_and_values(dataclasses.replace(_CFG, **changes))[1], reference,
                           str(changes))


def test_the_gradient_program_is_one_program_on_every_platform():
  # The model's gradients are autodiff's everywhere: lowered for cpu (where the tests run it), cuda
  # and tpu, the step's StableHLO is the same text, with no platform-dependent branch in it.
  traced = _grad_program(_CFG)
  texts = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda", "tpu")}
  assert texts["cpu"] == texts["cuda"] == texts["tpu"]
  ops = re.findall(r"= \"?(stablehlo\.[a-z_]+)", texts["cpu"])
  assert "stablehlo.dot_general" in ops and "stablehlo.case" not in ops


def test_preset_dtype_and_remat_stand_unless_the_config_sets_them():
  c = config_lib.default_config()
  c.model.size = "sdl_35m"
  assert (config_lib.model_config_of(c).dtype, config_lib.model_config_of(c).remat) == (
    "bfloat16",
    "dots",
  )
  c.model.dtype, c.model.remat = "float32", "none"
  assert (config_lib.model_config_of(c).dtype, config_lib.model_config_of(c).remat) == (
    "float32",
    "none",
  )
  c.model.size, c.model.dtype, c.model.remat = "tiny", "", ""
  assert (config_lib.model_config_of(c).dtype, config_lib.model_config_of(c).remat) == (
    "float32",
    "none",
  )


@pytest.mark.parametrize("name", ["sdl_35m", "sdl_1b"])
def test_paper_presets_hold_the_papers_block_parameters(name):
  cfg = models.PRESETS[name]
  shapes = jax.eval_shape(lambda: llama.init_params(cfg, 0))
  counted = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  assert counted == models.param_count(cfg)
  d, v, layers = cfg.d_model, cfg.vocab_size, cfg.num_layers
  blocks = counted - 2 * v * d - d  # embedding, untied head, final norm
  assert abs(blocks / (12 * d * d * layers) - 1) < 0.02


@pytest.mark.trainer  # a Trainer run: not in the fast tier
def test_trainer_with_dot_product_and_remat_follows_the_default_losses(tmp_path):
  # DiLoCo with one replica per device slice (shard_map over `replica`, the batch over `data`):
  # the same losses as the default model to float32 rounding of a ~5.5 loss.
  diloco = {"algorithm": "diloco", "num_replicas": 2, "outer.sync_every": 2, "num_steps": 4}
  losses = {}
  for name, changes in (("default", {}),
                        ("changed", {"model.attention": "dot_product", "model.remat": "dots"})):
    Trainer(tiny_config(**diloco, **changes), tmp_path / name).run()
    losses[name] = [m["loss"] for m in read_metrics(tmp_path / name) if "loss" in m]
  assert len(losses["default"]) == 4
  np.testing.assert_allclose(losses["changed"], losses["default"], rtol=64 * _EPS)
