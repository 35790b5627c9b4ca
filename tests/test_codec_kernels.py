"""Pallas codec kernels (interpret mode on CPU) are bit-identical to the jnp references.

Each case compiles one program holding the reference and the kernel for two
tensors: one whose size is a multiple of the block and one that is not (so
the last block is padded), with a grid of several steps whose last step is
partly padding rows. One block of the first tensor holds a NaN and one an
inf, to check the NaN policy is the same in both paths.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax import codecs, comm

CASES = [(name, "nearest") for name in ("e3m0", "e2m1", "int4", "int8", "bf16", "fp32")] + [
    (name, "stochastic") for name in ("e3m0", "e2m1", "int4", "int8", "bf16")]


def _inputs():
  rng = np.random.default_rng(0)
  aligned = rng.standard_normal((4, 64)).astype(np.float32)  # 4 blocks of 64
  aligned[1, 5] = np.nan
  aligned[3, 0] = -np.inf
  ragged = (rng.standard_normal((3, 37)) * np.exp(rng.uniform(-4, 4, (3, 37)))).astype(np.float32)
  return [aligned, ragged]


def _raw(array):
  """Bytes of an array, so that NaNs compare bit for bit."""
  return np.ascontiguousarray(np.asarray(array)).view(np.uint8)


@pytest.mark.parametrize("name,rounding", CASES)
def test_pallas_matches_reference_bit_for_bit(name, rounding):
  codec = codecs.get_codec(name, block_size=64, rounding=rounding)
  inputs = _inputs()

  @jax.jit
  def both_paths(xs, key):
    out = []
    for i, x in enumerate(xs):
      x_key = jax.random.fold_in(key, i)
      reference = codec.encode(x, x_key)
      kernel = codec.encode(x, x_key, use_pallas=True, interpret=True, rows_per_step=2)
      out.append((reference, kernel, codec.decode(reference),
                  codec.decode(reference, use_pallas=True, interpret=True, rows_per_step=2)))
    return out

  results = both_paths(inputs, jax.random.key(4, impl="rbg"))
  for x, (reference, kernel, decoded_ref, decoded_kernel) in zip(inputs, results):
    assert np.array_equal(_raw(kernel.codes), _raw(reference.codes))
    if reference.scales is None:
      assert kernel.scales is None
    else:
      assert np.array_equal(_raw(kernel.scales), _raw(reference.scales))
    assert np.array_equal(_raw(decoded_kernel), _raw(decoded_ref))
    assert decoded_ref.shape == x.shape
  if not codec.single_block:
    # 4 blocks at 2 per step: two grid steps; 3 blocks: two steps, the second with a padding row.
    assert results[0][0].codes.shape[0] == 4 and results[1][0].codes.shape[0] == 2


def _pallas_grids(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  return [eqn.params["grid_mapping"].grid for eqn in _pallas_eqns(jaxpr.jaxpr)]


def test_grid_steps_follow_tile_size():
  codec = codecs.get_codec("e3m0")  # blocks of 1024
  big = jax.ShapeDtypeStruct((1 << 20,), jnp.float32)
  # Default tile of 2^18 values: 1024 blocks in 4 steps (interpret mode pays ~12 ms a step).
  assert _pallas_grids(lambda x: codec.encode(x, use_pallas=True, interpret=True), big) == [(4,)]
  encoded = jax.eval_shape(codec.encode, big)
  assert _pallas_grids(lambda e: codec.decode(e, use_pallas=True, interpret=True),
                       encoded) == [(4,)]
  # 5 blocks, 2 per step: 3 steps, the last one half padding.
  small = jax.ShapeDtypeStruct((5 * 1024,), jnp.float32)
  assert _pallas_grids(lambda x: codec.encode(x, use_pallas=True, interpret=True,
                                              rows_per_step=2), small) == [(3,)]


def _streaming_e3m0_config(codec_kernels: str):
  from lowcomm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.default_config()
  return config_lib.override(c, {
      "algorithm": "streaming_diloco", "num_replicas": 2, "model.size": "tiny", "num_steps": 6,
      "data.seq_len": 32, "data.batch_size": 4, "eval.batch_size": 4, "eval.num_batches": 1,
      "eval.every": 1000, "checkpoint.every": 1000, "log_every": 1, "progress_bar": False,
      "hardware.peak_flops_per_device": 1e10, "diloco.sync_every": 2, "diloco.num_fragments": 1,
      "diloco.overlap_steps": 1, "diloco.merge_alpha": 0.5,
      "diloco.codec": "e3m0", "diloco.codec_block_size": 64, "diloco.error_feedback": True,
      "diloco.codec_kernels": codec_kernels, "mesh.data": 1})


@pytest.mark.trainer  # a Trainer run: not in the fast tier
def test_training_with_pallas_kernels_on_the_wire_is_bit_identical_to_the_reference(tmp_path):
  """diloco.codec_kernels=pallas (interpreted on CPU) trains Streaming DiLoCo (e3m0, error
  feedback, τ = 1, H = 2: two syncs in 6 steps, one compiled sync program) to exactly the
  reference's state."""
  from lowcomm_jax.train import Trainer  # pylint: disable=g-import-not-at-top
  final = {}
  for mode in ("pallas", "reference"):
    trainer = Trainer(_streaming_e3m0_config(mode), tmp_path / mode, devices=jax.devices()[:1])
    # Not vacuous: the configured mode reaches the optimizer, and its compressed mean runs the
    # Pallas kernels only in the pallas mode.
    tx = trainer.algorithm.tx
    assert tx.codec_kernels == mode
    jaxpr = str(jax.make_jaxpr(jax.vmap(
        lambda d: comm.compressed_mean(d, "replica", tx.codec, kernels=tx.codec_kernels),
        axis_name="replica"))(jnp.ones((2, 300))))
    assert ("pallas_call" in jaxpr) == (mode == "pallas")
    trainer.run()
    final[mode] = trainer.final_state
  state_p, state_r = final["pallas"], final["reference"]
  for a, b in zip(jax.tree.leaves((state_p.params, state_p.opt_state)),
                  jax.tree.leaves((state_r.params, state_r.opt_state)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The run really quantized (the residuals are not zero).
  assert any(float(jnp.abs(r).max()) > 0 for r in jax.tree.leaves(state_r.opt_state.comm.residuals))


def test_bad_codec_kernels_is_refused_naming_the_option():
  from lowcomm_jax.train import validation  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError,
                     match=r"diloco.codec_kernels must be one of .*auto.*pallas.*reference"):
    validation.validate(_streaming_e3m0_config("triton"))
  with pytest.raises(ValueError, match=r"diloco.codec_kernels must be one of"):
    codecs.kernel_options("cuda")
  assert codecs.kernel_options("reference") == dict(use_pallas=False, interpret=None)
  # Compiled on GPU/TPU; elsewhere interpreted (pallas) or the jnp reference (auto).
  assert codecs.kernel_options("pallas") == dict(use_pallas=True, interpret=None)
  assert codecs.kernel_options("auto") == dict(use_pallas=True, interpret=False)


def test_pallas_is_refused_where_no_compiled_kernel_exists():
  e3m0 = codecs.get_codec("e3m0")
  for platform in ("cuda", "tpu"):
    assert codecs.kernel_options("pallas", e3m0, platform)["use_pallas"]
    with pytest.raises(ValueError, match=r"diloco.codec_kernels=pallas: codec 'bf16'"):
      codecs.kernel_options("pallas", codecs.get_codec("bf16"), platform)
    with pytest.raises(ValueError, match=r"diloco.codec_kernels=pallas: codec 'e3m0' with block "
                                         r"size 65536"):
      codecs.kernel_options("pallas", codecs.get_codec("e3m0", block_size=1 << 16), platform)
  with pytest.raises(ValueError,
                     match=r"diloco.codec_kernels=pallas has no compiled kernel on rocm"):
    codecs.kernel_options("pallas", e3m0, "rocm")
  # auto never refuses: the reference runs where no compiled kernel exists.
  assert codecs.kernel_options("auto", codecs.get_codec("bf16"), "rocm")["use_pallas"]


@pytest.mark.parametrize("name", ["e3m0", "int8"])
def test_kernel_tiles_are_powers_of_two(name):
  """Blocks of 750 values (2250 in 3 blocks) reach the kernel as halves of 512 (4-bit) or rows of
  1024 (int8), and 3 rows per step as a tile of 4 rows: the shapes Triton takes."""
  codec = codecs.get_codec(name, block_size=1024)
  x = jax.ShapeDtypeStruct((2250,), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda x: codec.encode(x, use_pallas=True, interpret=True,
                                                rows_per_step=3))(x)
  shapes = [
    tuple(getattr(d, "block_size", d) for d in bm.block_shape)
    for eqn in _pallas_eqns(jaxpr.jaxpr)
    for bm in eqn.params["grid_mapping"].block_mappings
  ]
  assert shapes and all(d & (d - 1) == 0 for shape in shapes for d in shape
                        if isinstance(d, int)), shapes
  assert (4, 1024) in shapes


def _pallas_eqns(jaxpr):
  """The pallas_call equations of a jaxpr, inside the jitted kernels' calls too."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
      continue
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)  # a ClosedJaxpr's, or a Jaxpr
      if hasattr(inner, "eqns"):
        yield from _pallas_eqns(inner)
