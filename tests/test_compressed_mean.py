"""Compressed mean over the replica axis: vmap and an 8-device mesh, bounds, bytes, NaN.

The reference for a lossy codec is worked out here in numpy from the
algorithm's definition: every replica's chunks are rounded once (error within
the format's bound of each chunk), their fp32 mean is rounded once more by
the chunk's owner. So the result differs from the exact mean by at most the
mean of the senders' bounds plus the bound of the re-rounded mean.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from lowcomm_jax import codecs, comm
from lowcomm_jax.testing import assert_within, chunks, error_bound, sum_error_bound

M = 8
NAMES = ("e3m0", "e2m1", "int4", "int8", "bf16", "fp32")


def _replica_values(shape=(5, 37), seed=0):
  rng = np.random.default_rng(seed)
  # Replicas share a common signal plus their own noise, like outer gradients.
  common = rng.standard_normal(shape)
  return (common + 0.5 * rng.standard_normal((M,) + shape)).astype(np.float32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _vmapped_mean(x_R, codec, use_pallas=False, key=None):
  kernels = "pallas" if use_pallas else "reference"
  return jax.vmap(lambda x: comm.compressed_mean(x, "replica", codec, key=key, kernels=kernels),
                  axis_name="replica")(x_R)


def _chunked_bound(codec, x):
  """Bound of rounding ``x`` the way the mean does: each of the M chunks blocked on its own."""
  x_chunks = chunks(x, M)
  bound = np.stack([error_bound(codec, row) for row in x_chunks])
  return bound.reshape(-1)[:x.size].reshape(x.shape)


@pytest.mark.parametrize("name", NAMES)
def test_vmap_mean_within_codec_bound(name):
  codec = codecs.get_codec(name, block_size=16)
  x_R = _replica_values()
  mean_R = np.asarray(_vmapped_mean(jnp.asarray(x_R), codec))
  assert np.all(mean_R == mean_R[0])  # every replica ends with the same values
  exact = x_R.astype(np.float64).mean(0)
  sent_bound = np.mean([_chunked_bound(codec, x) for x in x_R], axis=0)
  # The owner re-rounds the mean of what it received, which is within sent_bound of exact.
  received_mean = exact + sent_bound * np.sign(exact)
  # fp32 summation of M values: at most about M ulps of the mean magnitude.
  sum_slack = M * np.finfo(np.float32).eps * np.abs(x_R.astype(np.float64)).mean(0)
  bound = sent_bound + _chunked_bound(codec, received_mean) + sum_slack
  error = np.abs(mean_R[0] - exact)
  assert np.all(error <= bound), float((error - bound).max())
  if name != "fp32":
    assert error.max() > 0  # the codec really rounded


def test_fp32_codec_equals_pmean():
  # Integers times 1/4: every partial sum is exact in fp32, so summation order cannot matter.
  x_R = jnp.asarray(np.random.default_rng(1).integers(-1000, 1000, (M, 3, 41)) / 4, jnp.float32)
  codec = codecs.get_codec("fp32")
  pmean = jax.vmap(lambda x: lax.pmean(x, "replica"), axis_name="replica")(x_R)
  assert np.array_equal(np.asarray(_vmapped_mean(x_R, codec)), np.asarray(pmean))
  # Arbitrary floats: only the order of the M fp32 additions may differ (the division by M = 8 is
  # exact), so the two means agree within the bound of a sum of M terms, divided by M.
  y_R = jnp.asarray(_replica_values(seed=2))
  pmean = jax.vmap(lambda x: lax.pmean(x, "replica"), axis_name="replica")(y_R)
  bound = sum_error_bound(np.abs(np.asarray(y_R, np.float64)).sum(0), M) / M
  for got, want in zip(np.asarray(_vmapped_mean(y_R, codec)), np.asarray(pmean)):
    assert_within(got, want, bound, "fp32 codec mean")


def test_mesh_with_shard_map_equals_vmap():
  mesh = jax.make_mesh((M,), ("replica",))
  x_R = jnp.asarray(_replica_values(shape=(3, 29), seed=3))
  x_sharded = jax.device_put(x_R, NamedSharding(mesh, P("replica")))
  for name, use_pallas in (("e3m0", False), ("fp32", False), ("e2m1", True)):
    codec = codecs.get_codec(name, block_size=8)
    # Interpret-mode Pallas kernels are not typed for shard_map's varying-axis
    # check (jax 0.10.2), so that case turns the check off.
    per_device = jax.shard_map(
        lambda x: comm.compressed_mean(
            x[0], "replica", codec, kernels="pallas" if use_pallas else "reference")[None],
        mesh=mesh, in_specs=P("replica"), out_specs=P("replica"), check_vma=not use_pallas)
    on_mesh = np.asarray(jax.jit(per_device)(x_sharded))
    simulated = np.asarray(_vmapped_mean(x_R, codec, use_pallas))
    assert np.array_equal(on_mesh, simulated), name
    if not use_pallas:  # the mean is typed as the same on every replica: it may leave replicated
      replicated = jax.shard_map(lambda x: comm.compressed_mean(x[0], "replica", codec), mesh=mesh,
                                 in_specs=P("replica"), out_specs=P())
      assert np.array_equal(np.asarray(jax.jit(replicated)(x_sharded)), simulated[0]), name


def test_pytree_input_and_stochastic_rounding():
  codec = codecs.get_codec("e3m0", block_size=16, rounding="stochastic")
  tree_R = {"w": jnp.asarray(_replica_values(shape=(4, 9))),
            "b": jnp.asarray(_replica_values(shape=(3,), seed=4))}
  mean_R = jax.jit(jax.vmap(
      lambda t: comm.compressed_mean(t, "replica", codec, key=jax.random.key(0, impl="rbg")),
      axis_name="replica"))(tree_R)
  for leaf in ("w", "b"):
    values = np.asarray(mean_R[leaf])
    assert np.all(values == values[0])
    exact = np.asarray(tree_R[leaf], np.float64).mean(0)
    sent = np.mean([_chunked_bound(codec, x) for x in np.asarray(tree_R[leaf])], axis=0)
    bound = sent + _chunked_bound(codec, np.abs(exact) + sent) + 1e-6
    assert np.all(np.abs(values[0] - exact) <= bound)


def test_nan_on_one_replica_poisons_its_blocks_everywhere():
  codec = codecs.get_codec("e3m0", block_size=4)
  x_R = _replica_values(shape=(64,))
  x_R[2, 10] = np.nan  # chunk 1 (values 8..15), block 10 // 4 = 2 -> values 8..11
  mean_R = np.asarray(_vmapped_mean(jnp.asarray(x_R), codec))
  nan_positions = np.flatnonzero(np.isnan(mean_R[0]))
  assert nan_positions.tolist() == list(range(8, 12))
  assert np.all(np.isnan(mean_R[:, 8:12]))
  with pytest.raises(codecs.NonFiniteError, match="fragment 0"):
    codecs.check_finite(x_R[2], "fragment 0")


def test_wire_bytes_per_worker():
  n = 1 << 20
  e3m0 = codecs.get_codec("e3m0", block_size=1024)
  fp32 = codecs.get_codec("fp32")
  chunk = n // M
  assert comm.compressed_mean_wire_bytes(n, e3m0, M) == 2 * (M - 1) * (
      chunk // 2 + 4 * (chunk // 1024))
  assert comm.compressed_mean_wire_bytes(n, fp32, M) == 2 * (M - 1) * 4 * chunk
  # A ring all-reduce's 2(M-1)/M of the tensor's encoded size.
  assert comm.compressed_mean_wire_bytes(n, fp32, M) == 2 * (M - 1) / M * fp32.wire_bytes(n)
  ratio = comm.compressed_mean_wire_bytes(n, e3m0, M) / comm.compressed_mean_wire_bytes(
      n, fp32, M)
  assert ratio == pytest.approx((4 + 32 / 1024) / 32)  # about 1/8 of fp32, scales included
  tree = {"a": jax.ShapeDtypeStruct((3, 100), jnp.float32), "b": jnp.zeros((7,))}
  assert comm.compressed_mean_wire_bytes(tree, e3m0, M) == (
      comm.compressed_mean_wire_bytes(300, e3m0, M) + comm.compressed_mean_wire_bytes(
          7, e3m0, M))
  assert comm.compressed_mean_wire_bytes(n, e3m0, 1) == 0
  # The bytes match what the collectives move: every encoded chunk is one row of the exchange.
  num_blocks, block_len = e3m0.layout(math.ceil(300 / M))
  assert e3m0.wire_bytes(math.ceil(300 / M)) == num_blocks * (block_len // 2 + 4)


def test_error_feedback_over_compressed_mean_stays_bounded():
  codec = codecs.get_codec("int4", block_size=16)
  rng = np.random.default_rng(6)
  base_R = _replica_values(shape=(48,), seed=7)
  state_R = codecs.init_error_feedback(jnp.zeros((M, 48)))

  @jax.jit
  def step(grad_R, state_R):
    def one_replica(g, s):
      mean, residual = comm.compressed_mean(g, "replica", codec, residual=s.residual)
      return mean, codecs.ErrorFeedbackState(residual)
    return jax.vmap(one_replica, axis_name="replica")(grad_R, state_R)

  residual_norms, sent_total, grad_total = [], 0.0, 0.0
  for _ in range(100):
    grad_R = base_R + 0.05 * rng.standard_normal(base_R.shape).astype(np.float32)
    corrected_R = grad_R + np.asarray(state_R.residual)
    mean_R, state_R = step(jnp.asarray(grad_R), state_R)
    residual = np.asarray(state_R.residual)
    # Each replica's residual is one rounding error of what it sent.
    for corrected, r in zip(corrected_R, residual):
      assert np.all(np.abs(r) <= _chunked_bound(codec, corrected))
    residual_norms.append(np.abs(residual).max())
    sent_total = sent_total + np.asarray(mean_R[0], np.float64)
    grad_total = grad_total + grad_R.astype(np.float64).mean(0)
  assert max(residual_norms[50:]) <= 1.5 * max(residual_norms[:50])
  # Senders' errors cancel over time; what is left is the owner's re-rounding of
  # each step's mean (not fed back), which is not systematic here.
  plain = np.asarray(_vmapped_mean(jnp.asarray(base_R), codec)[0], np.float64)
  drift_without_feedback = 100 * np.abs(plain - base_R.astype(np.float64).mean(0)).max()
  assert np.abs(sent_total - grad_total).max() < drift_without_feedback
