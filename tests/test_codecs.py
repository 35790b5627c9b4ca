"""Codecs: round trips within the format's error bound, exact codes, bytes, NaN/inf, rounding.

The error bounds are computed here from each format (its grid of magnitudes
and absmax scale), not from the library: the bound for one value is half the
gap between its two neighbouring representable values for round-to-nearest,
the whole gap for stochastic rounding, plus a slack for fp32 rounding of the
scale and for XLA flushing denormals on CPU.
"""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lowcomm_jax import codecs, testing
from lowcomm_jax.testing import GRIDS, error_bound

NAMES = ("e3m0", "e2m1", "int4", "int8", "bf16", "fp32")
LOSSY = ("e3m0", "e2m1", "int4", "int8", "bf16")


@functools.partial(jax.jit, static_argnums=0)
def roundtrip(codec, x, key=None):
  """``codec.roundtrip`` compiled once per codec and shape (eager dispatch is slow)."""
  return codec.roundtrip(x, key)


@functools.partial(jax.jit, static_argnums=0)
def encode(codec, x, key=None):
  return codec.encode(x, key)


# ------------------------------------------------------------------ inputs
def _inputs():
  rng = np.random.default_rng(0)
  return {
      "random": rng.standard_normal((3, 50)).astype(np.float32),
      "wide_range": (rng.standard_normal(300) * np.exp(rng.uniform(-8, 8, 300))).astype(np.float32),
      "constant": np.full((7,), -3.3, np.float32),
      "zeros": np.zeros((4, 5), np.float32),
      "denormal": (rng.standard_normal(40) * 1e-40).astype(np.float32),
      "tiny": (rng.standard_normal(40) * 1e-30).astype(np.float32),
      "huge": (rng.standard_normal((2, 33)) * 3e37).astype(np.float32),
      "scalar": np.array(0.7, np.float32),
  }


INPUTS = _inputs()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", NAMES)
def test_roundtrip_within_format_bound(name, rounding):
  codec = codecs.get_codec(name, block_size=32, rounding=rounding)
  # Stochastic rounding compiles slower: its cases are the ones where it differs.
  inputs = INPUTS if rounding == "nearest" else {
      label: INPUTS[label] for label in ("wide_range", "zeros", "denormal", "huge")}
  # One compiled program for all inputs: compiling per input dominates the time.
  all_decoded = jax.jit(lambda xs, key: {label: codec.roundtrip(x, jax.random.fold_in(key, i))
                                         for i, (label, x) in enumerate(sorted(xs.items()))})(
                                             inputs, jax.random.key(3, impl="rbg"))
  for label, x in inputs.items():
    decoded = np.asarray(all_decoded[label])
    assert decoded.shape == x.shape and decoded.dtype == np.float32, label
    error = np.abs(decoded.astype(np.float64) - x)
    bound = error_bound(codec, x)
    assert np.all(error <= bound), (label, float((error - bound).max()))
    if label == "zeros":
      assert np.all(decoded == 0), label
    if label == "constant" and name in ("e3m0", "fp32", "int4", "int8"):
      # absmax sits on the top of the grid: the scale absmax / top and its product with the top
      # code, two roundings.
      testing.assert_within(decoded, x, testing.operation_error_bound(np.abs(x), 2), label)


def test_fp32_is_lossless_and_bf16_matches_cast():
  x = INPUTS["wide_range"]
  assert np.array_equal(np.asarray(roundtrip(codecs.get_codec("fp32"), x)), x)
  expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  assert np.array_equal(np.asarray(roundtrip(codecs.get_codec("bf16"), x)), expected)


def _unpacked_codes(codec, x):
  """Per-value 4-bit codes and block scales, undoing the half-split packing."""
  encoded = encode(codec, jnp.asarray(x))
  packed = np.asarray(encoded.codes)
  codes = np.concatenate([packed & 0xF, packed >> 4], axis=1)
  return codes.reshape(-1)[:x.size], np.asarray(encoded.scales)


def test_e2m1_codes_are_ml_dtypes_float4_e2m1fn_bits():
  # Values in units of the scale (absmax 6), including every tie between grid points.
  units = np.array([6.0, -6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, 0.1, 2.9,
                    4.2, -1.1, 0.0, 5.99, 0.26], np.float32)
  codec = codecs.get_codec("e2m1", block_size=units.size)
  codes, scales = _unpacked_codes(codec, units)
  assert scales.tolist() == [1.0]
  expected = units.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
  expected[(expected & 0x7) == 0] = 0  # the codec never emits negative zero
  assert codes.tolist() == expected.tolist()


@pytest.mark.parametrize("name", ["e3m0", "int4"])
def test_grid_codes_are_nearest_with_ties_to_even(name):
  grid = GRIDS[name]
  midpoints = (grid[1:] + grid[:-1]) / 2
  units = np.concatenate([grid, midpoints, midpoints * 0.999, midpoints * 1.001,
                          -midpoints, [grid[-1]]]).astype(np.float32)
  codec = codecs.get_codec(name, block_size=units.size)
  codes, scales = _unpacked_codes(codec, units)
  assert scales.tolist() == [1.0]  # absmax = grid top, so units are the grid's own
  distance = np.abs(np.abs(units)[:, None].astype(np.float64) - grid[None, :])
  nearest = []
  for row in distance:
    candidates = np.flatnonzero(np.isclose(row, row.min(), rtol=0, atol=1e-12))
    even = [c for c in candidates if c % 2 == 0]
    nearest.append(even[0] if len(candidates) > 1 else candidates[0])
  sign = ((units < 0) & (np.array(nearest) > 0)).astype(int)
  assert codes.tolist() == (np.array(nearest) | (sign << 3)).tolist()


def test_e3m0_values_are_signed_powers_of_two_of_absmax():
  x = INPUTS["wide_range"]
  codec = codecs.get_codec("e3m0", block_size=x.size)
  decoded = np.asarray(roundtrip(codec, x), np.float64)
  absmax = np.abs(x).max()
  ratios = np.abs(decoded[decoded != 0]) / absmax
  exponents = np.log2(ratios)
  assert np.allclose(exponents, np.round(exponents), atol=1e-6)
  assert exponents.min() >= -6 and exponents.max() <= 0
  # Everything below absmax / 128 rounds to zero, everything above does not.
  assert np.all((decoded == 0) == (np.abs(x) <= absmax / 128))


@pytest.mark.parametrize("name", NAMES)
def test_any_shape_and_size(name):
  codec = codecs.get_codec(name, block_size=16)
  rng = np.random.default_rng(1)
  xs = [jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in [(), (0,), (1,), (5, 3, 7), (2, 0, 3), (17,)]]
  encoded_all = jax.jit(lambda xs: [codec.encode(x) for x in xs])(xs)
  decoded_all = jax.jit(lambda es: [codec.decode(e) for e in es])(encoded_all)
  for x, encoded, decoded in zip(xs, encoded_all, decoded_all):
    assert encoded.shape == x.shape and decoded.shape == x.shape
    assert encoded.payload_bytes == codec.wire_bytes(x.size)
    assert np.all(np.abs(np.asarray(decoded) - np.asarray(x)) <= error_bound(codec, x))


@pytest.mark.parametrize("block_size", [16, 64, 1024])
def test_wire_bytes_are_packed_payload_plus_scales(block_size):
  for k in range(4, 13):
    n = 2**k
    blocks_n = math.ceil(n / block_size)
    for name in ("e3m0", "e2m1", "int4"):
      assert codecs.get_codec(name, block_size).wire_bytes(n) == 2**(k - 1) + 4 * blocks_n
    assert codecs.get_codec("int8", block_size).wire_bytes(n) == n + 4 * blocks_n
    assert codecs.get_codec("bf16", block_size).wire_bytes(n) == 2 * n
    assert codecs.get_codec("fp32", block_size).wire_bytes(n) == 4 * n
  # Encoded arrays hold exactly what wire_bytes counts, for awkward sizes too.
  for name in NAMES:
    codec = codecs.get_codec(name, block_size)
    for n in (1, 3, 1000, 1025, 4097):
      encoded = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct((n,), jnp.float32))
      assert encoded.payload_bytes == codec.wire_bytes(n), (name, n)
      assert encoded.codes.dtype == {"bf16": jnp.bfloat16, "fp32": jnp.float32,
                                     "int8": jnp.int8}.get(name, jnp.uint8)


def test_per_tensor_scaling_when_block_covers_tensor():
  x = jnp.asarray(INPUTS["random"])
  encoded = encode(codecs.get_codec("e3m0", block_size=x.size), x)
  assert encoded.scales.shape == (1,)
  assert float(encoded.scales[0]) == float(jnp.max(jnp.abs(x)))
  # e3m0 at 1024-value blocks: 4 bits + 32/1024 bits of scale per value, ~1/8 of fp32.
  assert codecs.get_codec("e3m0").bits_per_parameter(1 << 20) == 4 + 32 / 1024


def test_blocks_are_balanced_so_padding_is_small():
  codec = codecs.get_codec("e2m1", block_size=1024)
  assert codec.layout(1025) == (2, 514)
  assert codec.layout(5000) == (5, 1000)
  assert codec.layout(7) == (1, 8)


def test_bad_options_name_the_option_and_allowed_values():
  with pytest.raises(ValueError, match=r"codec: unknown codec 'fp4'; allowed: e3m0, e2m1, int4, "
                     r"int8, bf16, fp32"):
    codecs.get_codec("fp4")
  with pytest.raises(ValueError, match="rounding: must be one of nearest, stochastic"):
    codecs.get_codec("e3m0", rounding="up")
  with pytest.raises(ValueError, match="block_size: must be an integer >= 2"):
    codecs.get_codec("int8", block_size=0)
  with pytest.raises(ValueError, match="rounding.*needs a PRNG key"):
    codecs.get_codec("int4", rounding="stochastic").encode(jnp.ones(4))


@pytest.mark.parametrize("name", ["e3m0", "e2m1", "int4", "int8"])
def test_nan_or_inf_makes_its_block_nan_and_leaves_other_blocks_alone(name):
  codec = codecs.get_codec(name, block_size=8)
  x = np.linspace(-1, 1, 24).astype(np.float32)
  clean = np.asarray(roundtrip(codec, x))
  for bad in (np.nan, np.inf, -np.inf):
    poisoned = x.copy()
    poisoned[10] = bad
    encoded = encode(codec, poisoned)
    assert np.isnan(np.asarray(encoded.scales)).tolist() == [False, True, False]
    assert np.all(np.asarray(encoded.codes)[1] == 0)
    decoded = np.asarray(codec.decode(encoded))
    assert np.all(np.isnan(decoded[8:16]))
    np.testing.assert_array_equal(decoded[:8], clean[:8])
    np.testing.assert_array_equal(decoded[16:], clean[16:])


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_bf16_and_fp32_carry_nan_and_inf_per_value(rounding):
  x = np.array([1.0, np.nan, np.inf, -np.inf, -2.5], np.float32)
  for name in ("bf16", "fp32"):
    decoded = np.asarray(roundtrip(codecs.get_codec(name, rounding=rounding), x,
                                   jax.random.key(0, impl="rbg")))
    assert np.isnan(decoded[1]) and decoded[2] == np.inf and decoded[3] == -np.inf
    assert decoded[0] == 1.0 and decoded[4] == -2.5


def test_check_finite_names_the_fragment_and_all_finite_works_under_jit():
  tree = {"w": jnp.ones((3, 2)), "b": jnp.array([0.0, jnp.nan, jnp.inf], jnp.bfloat16)}
  with pytest.raises(codecs.NonFiniteError, match=r"fragment 2: non-finite.*\['b'\]: 1 NaN, 1 inf "
                     r"of 3 values"):
    codecs.check_finite(tree, "fragment 2")
  codecs.check_finite({"w": jnp.ones(3)}, "fragment 0")  # no error
  assert not bool(jax.jit(codecs.all_finite)(tree))
  assert bool(jax.jit(codecs.all_finite)({"w": jnp.ones(3)}))


@pytest.mark.parametrize("name", LOSSY)
def test_stochastic_rounding_is_unbiased(name):
  codec = codecs.get_codec(name, block_size=64, rounding="stochastic")
  rng = np.random.default_rng(7)
  x = np.concatenate([[4.0], rng.uniform(-4, 4, 63)]).astype(np.float32)
  num_draws = 4000
  keys = jax.random.split(jax.random.key(11, impl="rbg"), num_draws)
  draws = np.asarray(jax.jit(jax.vmap(lambda k: codec.roundtrip(jnp.asarray(x), k)))(keys),
                     np.float64)
  # Each draw is one of the two neighbours: variance <= gap^2 / 4, so the mean
  # of N draws lies within 5 standard errors of x with overwhelming probability.
  gap = error_bound(codec, x, stochastic=True)
  assert np.all(np.abs(draws - x) <= gap)
  assert np.all(np.abs(draws.mean(0) - x) <= 5 * (gap / 2) / math.sqrt(num_draws) + 1e-7)
  # Round-to-nearest is biased on the same values (otherwise the test is vacuous).
  nearest = np.asarray(roundtrip(codecs.get_codec(name, block_size=64), x), np.float64)
  assert np.abs(nearest - x).max() > 10 * np.abs(draws.mean(0) - x).max()


@pytest.mark.parametrize("name", ["e3m0", "e2m1", "int4", "int8"])
def test_error_feedback_residual_stays_bounded_and_errors_cancel(name):
  codec = codecs.get_codec(name, block_size=32)
  rng = np.random.default_rng(5)
  # A slowly drifting gradient with an offset that the grid cannot represent.
  base = rng.standard_normal(100).astype(np.float32)
  state = codecs.init_error_feedback(jnp.zeros(100))
  step = jax.jit(lambda g, s: codecs.error_feedback_roundtrip(g, s, codec))
  sent_total = np.zeros(100)
  grad_total = np.zeros(100)
  grad_max, residual_norms = 0.0, []
  for t in range(300):
    grad = base + 0.1 * rng.standard_normal(100).astype(np.float32)
    decoded, state = step(jnp.asarray(grad), state)
    sent_total += np.asarray(decoded)
    grad_total += grad
    grad_max = max(grad_max, float(np.abs(grad).max()))
    residual_norms.append(float(np.abs(np.asarray(state.residual)).max()))
    # The residual is one quantization error of (grad + previous residual).
    corrected = np.asarray(decoded, np.float64) + np.asarray(state.residual)
    assert np.all(np.abs(np.asarray(state.residual)) <= error_bound(codec, corrected))
  # Errors telescope: what was sent in total equals the total gradient minus the last residual, up
  # to each step's float32 rounding of (grad + residual) − decoded (2 roundings of values below
  # max|grad| + max|residual|), 300 steps; the float64 totals add nothing that matters.
  magnitude = grad_max + max(residual_norms)
  testing.assert_within(sent_total, grad_total - np.asarray(state.residual),
                        300 * testing.operation_error_bound(magnitude, 2), "telescoped sum")
  # Bounded: no growth between the first and last hundred steps.
  assert max(residual_norms[200:]) <= 1.5 * max(residual_norms[:100])
  # Without error feedback a fixed rounding error of the mean gradient adds up
  # over 300 steps; with it the total error is one residual.
  drift = np.abs(300 * (np.asarray(roundtrip(codec, base), np.float64) - base)).max()
  assert np.abs(sent_total - grad_total).max() < drift / 10


def test_error_table_matches_direct_computation():
  from lowcomm_jax.codecs import analysis
  rng = np.random.default_rng(9)
  tree = {"a": jnp.asarray(rng.standard_normal((40, 30)), jnp.float32),
          "b": jnp.asarray(rng.standard_normal(7), jnp.float32)}
  rows = analysis.error_table(tree, names=("e2m1", "fp32"), block_sizes=(64,))
  e2m1 = codecs.get_codec("e2m1", block_size=64)
  decoded = {k: np.asarray(roundtrip(e2m1, v), np.float64) for k, v in tree.items()}
  expected = math.sqrt(sum(((decoded[k] - np.asarray(tree[k])) ** 2).sum() for k in tree)
                       / sum((np.asarray(v, np.float64) ** 2).sum() for v in tree.values()))
  assert rows[0]["codec"] == "e2m1"
  assert rows[0]["relative_rms"]["64"] == pytest.approx(expected, rel=1e-5)
  assert rows[0]["bits_per_value"]["64"] == 8 * (e2m1.wire_bytes(1200) + e2m1.wire_bytes(7)) / 1207
  assert rows[0]["bits_per_value"]["per_tensor"] == 8 * (600 + 4 + 4 + 4) / 1207
  assert rows[1]["relative_rms"] == {"64": 0.0, "per_tensor": 0.0}


@pytest.mark.trainer  # a Trainer run: not in the fast tier
def test_the_outer_gradient_is_replica_0s_progress_from_the_start(tmp_path):
  """codecs.analysis measures on a real outer gradient: Δ = θ_start − θ_end of replica 0 of the
  Trainer's DiLoCo run, stopped before its first sync (so φ is still θ_start)."""
  from lowcomm_jax.codecs import analysis
  from lowcomm_jax.train import Trainer, outer_gradient
  delta, info = outer_gradient.diloco_outer_gradient("tiny", 2, inner_steps=3)
  assert info["inner_steps"] == 3 and 4 < info["train_loss"] < 6  # bytes: ln 256 = 5.5 at the start
  config = outer_gradient.outer_gradient_config("tiny", 2, 3)
  again = Trainer(config, tmp_path)  # the same run again (runs are deterministic)
  start = jax.device_get(again.init_params())
  _, again_final = testing.run_to_end(again)
  end = jax.device_get(jax.tree.map(lambda x: x[0], again_final.state.params))
  assert jax.tree.structure(delta) == jax.tree.structure(start)
  for d, s, e in zip(jax.tree.leaves(delta), jax.tree.leaves(start), jax.tree.leaves(end),
                     strict=True):
    np.testing.assert_array_equal(d, s - e)
  assert all(np.any(d != 0) for d in jax.tree.leaves(delta))  # every parameter moved
  rows = analysis.error_table(delta, names=("int8", "fp32"), block_sizes=(1024,))
  assert rows[1]["relative_rms"]["1024"] == 0.0 and 0 < rows[0]["relative_rms"]["1024"] < 0.02
