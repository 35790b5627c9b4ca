"""Pallas codec kernels (interpret mode on CPU) are bit-identical to the jnp references.

Each case compiles one program holding the reference and the kernels (the Triton and TPU kernel
body, and the Mosaic GPU one) for two tensors: one whose size is a multiple of the block and one
that is not (so the last block is padded), with a grid of several steps whose last step is
partly padding rows. One block of the first tensor holds a NaN and one an
inf, to check the NaN policy is the same in both paths.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax import codecs, comm, testing
from lowcomm_jax.codecs import kernels

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
      kernel_outputs = []
      for gpu in kernels.GPU_KERNELS:
        options = dict(use_pallas=True, interpret=True, rows_per_step=2, gpu=gpu)
        kernel_outputs.append((codec.encode(x, x_key, **options),
                               codec.decode(reference, **options)))
      out.append((reference, codec.decode(reference), kernel_outputs))
    return out

  results = both_paths(inputs, jax.random.key(4, impl="rbg"))
  for x, (reference, decoded_ref, kernel_outputs) in zip(inputs, results):
    for kernel, decoded_kernel in kernel_outputs:
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
  # 5 blocks, 2 per step: 3 steps, the last one half padding; Mosaic GPU takes at least 8 blocks
  # a step (its scales' tile is then 128 bytes): 20 blocks in 3 steps.
  small = jax.ShapeDtypeStruct((5 * 1024,), jnp.float32)
  encode = lambda x, gpu: codec.encode(x, use_pallas=True, interpret=True, rows_per_step=2, gpu=gpu)
  assert _pallas_grids(lambda x: encode(x, "triton"), small) == [(3,)]
  assert _pallas_grids(lambda x: encode(x, "mosaic_gpu"), small) == [(1,)]
  assert _pallas_grids(lambda x: encode(x, "mosaic_gpu"),
                       jax.ShapeDtypeStruct((20 * 1024,), jnp.float32)) == [(3,)]


def _streaming_e3m0_config(codec_kernels: str):
  from lowcomm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.default_config()
  return config_lib.override(c, {
      "algorithm": "streaming_diloco", "num_replicas": 2, "model.size": "tiny", "num_steps": 6,
      "data.seq_len": 32, "data.batch_size": 4, "eval.batch_size": 4, "eval.num_batches": 1,
      "eval.every": 1000, "checkpoint.every": 1000, "log_every": 1, "progress_bar": False,
      "hardware.peak_flops_per_device": 1e10, "outer.sync_every": 2, "outer.num_fragments": 1,
      "outer.overlap_steps": 1, "outer.merge_alpha": 0.5,
      "outer.codec": "e3m0", "outer.codec_block_size": 64, "outer.error_feedback": True,
      "outer.codec_kernels": codec_kernels, "mesh.data": 1})


@pytest.mark.trainer  # a Trainer run: not in the fast tier
def test_training_with_pallas_kernels_on_the_wire_is_bit_identical_to_the_reference(tmp_path):
  """outer.codec_kernels=pallas (interpreted on CPU) trains Streaming DiLoCo (e3m0, error
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
    summary, trainer_final = testing.run_to_end(trainer)
    # What encoded on the wire, as summary.json records it: on CPU, pallas interprets the kernel
    # body of the GPU kernel picked for this jax version.
    assert summary["codec_kernel"] == ("reference" if mode == "reference" else
                                       f"pallas_interpret_{kernels.gpu_kernel()}")
    final[mode] = trainer_final.state
  state_p, state_r = final["pallas"], final["reference"]
  for a, b in zip(jax.tree.leaves((state_p.params, state_p.opt_state)),
                  jax.tree.leaves((state_r.params, state_r.opt_state)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The run really quantized (the residuals are not zero).
  assert any(float(jnp.abs(r).max()) > 0 for r in jax.tree.leaves(state_r.opt_state.comm.residuals))


def test_bad_codec_kernels_is_refused_naming_the_option():
  from lowcomm_jax.train import validation  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=r"outer.codec_kernels must be one of .*auto.*pallas.*"
                                       r"pallas_mosaic_gpu.*pallas_triton.*reference"):
    validation.validate(_streaming_e3m0_config("triton"))
  with pytest.raises(ValueError, match=r"outer.codec_kernels must be one of"):
    codecs.kernel_options("cuda")
  assert codecs.kernel_options("reference") == dict(use_pallas=False, interpret=None)
  # Compiled on GPU/TPU; elsewhere interpreted (pallas*) or the jnp reference (auto); the GPU
  # kernel picked where the program is traced (None) or forced.
  assert codecs.kernel_options("pallas") == dict(use_pallas=True, interpret=None, gpu=None)
  assert codecs.kernel_options("auto") == dict(use_pallas=True, interpret=False, gpu=None)
  for gpu in kernels.GPU_KERNELS:
    assert codecs.kernel_options(f"pallas_{gpu}") == dict(use_pallas=True, interpret=None, gpu=gpu)


A100 = jax.sharding.AbstractDevice("NVIDIA A100-SXM4-80GB", platform="gpu", num_cores=None)
H100 = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", platform="gpu", num_cores=None)


def test_pallas_is_refused_where_no_compiled_kernel_exists():
  e3m0 = codecs.get_codec("e3m0")
  for mode in ("pallas", "pallas_mosaic_gpu", "pallas_triton"):
    for platform in ("cuda", "tpu") if mode == "pallas" else ("cuda",):
      assert codecs.kernel_options(mode, e3m0, platform, H100)["use_pallas"]
      with pytest.raises(ValueError, match=rf"outer.codec_kernels={mode}: codec 'bf16'"):
        codecs.kernel_options(mode, codecs.get_codec("bf16"), platform, H100)
      with pytest.raises(ValueError, match=rf"outer.codec_kernels={mode}: codec 'e3m0' with block "
                                           r"size 65536"):
        codecs.kernel_options(mode, codecs.get_codec("e3m0", block_size=1 << 16), platform, H100)
    with pytest.raises(ValueError, match=rf"outer.codec_kernels={mode} has no compiled kernel on "
                                         r"rocm"):
      codecs.kernel_options(mode, e3m0, "rocm")
  for gpu in kernels.GPU_KERNELS:
    with pytest.raises(ValueError, match=rf"outer.codec_kernels=pallas_{gpu} has no compiled "
                                         r"kernel on tpu \(only on cuda\)"):
      codecs.kernel_options(f"pallas_{gpu}", e3m0, "tpu")
  # Mosaic GPU on an Ampere: refused where this jax compiles it for Hopper and newer only.
  refusal = kernels.gpu_kernel_refusal("mosaic_gpu", A100)
  assert (refusal is not None) == (tuple(map(int, jax.__version__.split(".")[:2])) < (0, 11))
  if refusal:
    assert "compute capability 9.0 and newer; NVIDIA A100-SXM4-80GB has 8.0" in refusal
    with pytest.raises(ValueError, match=r"^outer.codec_kernels=pallas_mosaic_gpu: Pallas "
                                         r"Mosaic GPU in jax .* use outer.codec_kernels=auto or "
                                         r"reference$"):
      codecs.kernel_options("pallas_mosaic_gpu", e3m0, "cuda", A100)
  # auto never refuses: the reference runs where no compiled kernel exists.
  assert codecs.kernel_options("auto", codecs.get_codec("bf16"), "rocm")["use_pallas"]


def test_kernel_choice_names_what_encodes_on_the_wire():
  e3m0, bf16 = codecs.get_codec("e3m0"), codecs.get_codec("bf16")
  assert codecs.kernel_choice("auto", e3m0, "cuda", H100) == "pallas_mosaic_gpu"
  assert codecs.kernel_choice("pallas_triton", e3m0, "cuda", H100) == "pallas_triton"
  assert codecs.kernel_choice("auto", e3m0, "cuda", A100) == f"pallas_{kernels.gpu_kernel(A100)}"
  assert codecs.kernel_choice("auto", e3m0, "tpu") == "pallas_tpu"
  assert codecs.kernel_choice("auto", e3m0, "cpu") == "reference"
  assert codecs.kernel_choice("auto", bf16, "cuda", H100) == "reference"
  assert codecs.kernel_choice("reference", e3m0, "cuda", H100) == "reference"
  assert codecs.kernel_choice("pallas", e3m0, "cpu", H100) == "pallas_interpret_mosaic_gpu"
  assert codecs.kernel_choice("pallas_triton", e3m0, "cpu") == "pallas_interpret_triton"


@pytest.mark.parametrize("name", ["e3m0", "int8"])
def test_kernel_tiles_are_powers_of_two(name):
  """Blocks of 750 values (2250 in 3 blocks) reach the kernel as halves of 512 (4-bit) or rows of
  1024 (int8), and 3 rows per step as a tile of 4 rows: the shapes Triton takes."""
  codec = codecs.get_codec(name, block_size=1024)
  x = jax.ShapeDtypeStruct((2250,), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda x: codec.encode(x, use_pallas=True, interpret=True,
                                                rows_per_step=3, gpu="triton"))(x)
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


def _gpus():
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def _cpu(tree):
  return jax.device_put(tree, jax.devices("cpu")[0])


@pytest.mark.skipif(not _gpus(), reason="compiles the GPU kernels: needs a GPU (CPU hosts check "
                    "them in interpret mode above and by lowering, tests/test_lowering.py)")
@pytest.mark.parametrize("gpu", [k for k in kernels.GPU_KERNELS if kernels.gpu_kernel_available(k)])
def test_compiled_gpu_kernels_match_the_reference_bit_for_bit(gpu):
  """Each codec's compiled GPU kernel (`gpu`) on this host's GPU codes and decodes as the jnp
  reference does on CPU, bit for bit (NaN for NaN: a NaN's bits are the processor's arithmetic's):
  blocks of 1024 and of 64 (padded to the kernel's smallest row) rounding to nearest, blocks of
  1024 rounding stochastically, on the NaN/inf and ragged tensors above and a tensor of 2^20 + 37
  values (many tiles and thread blocks, the last one mostly padding)."""
  if kernels.gpu_kernel_refusal(gpu, _gpus()[0]):
    pytest.skip(kernels.gpu_kernel_refusal(gpu, _gpus()[0]))
  rng = np.random.default_rng(1)
  large = (rng.standard_normal(1 << 20 | 37) * np.exp(rng.uniform(-8, 8, 1 << 20 | 37)))
  inputs = _inputs() + [large.astype(np.float32)]
  failures = []
  for name in ("e3m0", "e2m1", "int4", "int8"):
    for rounding, block_size in (("nearest", 1024), ("nearest", 64), ("stochastic", 1024)):
      codec = codecs.get_codec(name, block_size=block_size, rounding=rounding)
      key = jax.random.key(5)  # threefry: the same bits on every backend

      def both(xs, key, **options):
        encoded = [codec.encode(x, jax.random.fold_in(key, i), **options)
                   for i, x in enumerate(xs)]
        return encoded, [codec.decode(e, **options) for e in encoded]

      reference = jax.jit(both)(_cpu(inputs), _cpu(key))
      compiled = jax.jit(functools.partial(both, use_pallas=True, interpret=None, gpu=gpu))(
          jax.device_put(inputs, _gpus()[0]), jax.device_put(key, _gpus()[0]))
      for leaf, (want, got) in enumerate(zip(jax.tree.leaves(reference),
                                             jax.tree.leaves(compiled), strict=True)):
        want, got = np.asarray(want), np.asarray(got)
        nan = np.isnan(want) if want.dtype == np.float32 else np.zeros(want.shape, bool)
        # A NaN for a NaN: the bits of a NaN that arithmetic gives are the processor's.
        if not (np.array_equal(nan, np.isnan(got) if got.dtype == np.float32 else nan)
                and np.array_equal(_raw(want[~nan]), _raw(got[~nan]))):
          failures.append(f"{name} {rounding} block {block_size} leaf {leaf}: "
                          f"{int((_raw(want) != _raw(got)).sum())} bytes differ")
  assert not failures, "\n".join(failures)
