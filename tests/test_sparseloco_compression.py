"""SparseLoCo's compression on the wire: chunked top-k, 1/2-bit levels, the sparse mean, its bytes.

The reference is a numpy oracle of one SparseLoCo round over M workers, written from the method's
definition (error feedback e ← β·e + Δ, per-chunk top-k with ties to the lowest index, sign plus
per-bin mean magnitude, the mean of the M decoded payloads, the new residual e − decode(own)). It
works in float64 on the float32 buffer the workers compress (β = 0.5, so β·e + Δ has one rounding,
the same in numpy and XLA): which entries are kept, their bins and signs are then exact, and what
remains is the float32 rounding of the level means, of the sum over workers and of the divisions,
bounded from their lengths and magnitudes (`sum_error_bound`).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from lowcomm_jax import codecs, comm, hlo
from lowcomm_jax.codecs import packing
from lowcomm_jax.error_bounds import sum_error_bound
from lowcomm_jax.testing import collective_bytes

M = 4
DECAY = 0.5  # a power of two: β·e is exact, so the buffer the workers compress is the oracle's
U = 2.0**-24  # float32's unit roundoff: one correctly rounded operation


def _oracle_payload(flat32, compressor):
  """One worker's tensor (float32, flat) to (positions, float64 decoded values, their bound)."""
  n = flat32.size
  c, chunk_len, k, _ = compressor.layout(n)
  positions, values, bounds = [], [], []
  for chunk in range(c):
    segment = flat32[chunk * chunk_len:(chunk + 1) * chunk_len]
    kept = np.argsort(-np.abs(segment), kind="stable")[:k]  # ties: the lowest index first
    value = segment[kept].astype(np.float64)
    magnitude = np.abs(value)
    if compressor.bits == 1:
      level_of = np.zeros(kept.size, int)
    else:  # the bin edge, as specified: the float32 midpoint of the kept magnitudes' range
      edge = (np.float32(magnitude.max()) + np.float32(magnitude.min())) * np.float32(0.5)
      level_of = (magnitude >= edge).astype(int)
    level = np.zeros(compressor.num_levels)
    bound = np.zeros(compressor.num_levels)
    for j in range(compressor.num_levels):
      members = magnitude[level_of == j]
      if members.size:
        level[j] = members.mean()
        # float32 sum of the members, then one division (and float64's own rounding, far smaller)
        bound[j] = (sum_error_bound(members.sum(), members.size) / members.size + U * level[j]
                    + sum_error_bound(members.sum(), members.size, np.float64))
    positions.append(chunk * chunk_len + kept)
    values.append(np.where(value < 0, -level[level_of], level[level_of]))
    bounds.append(bound[level_of])
  return np.concatenate(positions), np.concatenate(values), np.concatenate(bounds)


def _oracle_round(x_R, e_R, compressor):
  """One SparseLoCo round of one tensor over the M workers: (mean, bound, new residuals, bound)."""
  corrected_R = (np.float32(DECAY) * e_R + x_R).astype(np.float32)  # float32, one rounding
  shape = x_R.shape[1:]
  sent_R, sent_bound_R = [], []
  for corrected in corrected_R:
    positions, values, bounds = _oracle_payload(corrected.reshape(-1), compressor)
    dense, dense_bound = np.zeros(corrected.size), np.zeros(corrected.size)
    dense[positions], dense_bound[positions] = values, bounds
    sent_R.append(dense)
    sent_bound_R.append(dense_bound)
  sent_R, sent_bound_R = np.stack(sent_R), np.stack(sent_bound_R)
  mean = sent_R.sum(0) / M
  # The workers' level errors, the float32 sum of M terms, the division by M.
  mean_bound = (sent_bound_R.sum(0) / M + sum_error_bound(np.abs(sent_R).sum(0), M) / M
                + U * np.abs(mean))
  residual_R = corrected_R.reshape(M, -1).astype(np.float64) - sent_R
  residual_bound_R = sent_bound_R + U * np.abs(residual_R)
  return (mean.reshape(shape), mean_bound.reshape(shape), residual_R.reshape(x_R.shape),
          residual_bound_R.reshape(x_R.shape))


def _vmapped_round(tree_R, residual_R, compressor):
  return jax.jit(jax.vmap(
      lambda t, e: comm.sparse_mean(t, "replica", compressor, residual=e, decay=DECAY),
      axis_name="replica"))(tree_R, residual_R)


def _tree_R(seed):
  rng = np.random.default_rng(seed)
  # A common signal plus each worker's own noise, like outer gradients. "w" ends in a partial chunk
  # for chunk_size 64 (300 = 4·64 + 44); "b" is smaller than a chunk.
  make = lambda shape: (rng.standard_normal(shape) + 0.5 * rng.standard_normal((M,) + shape))
  return ({"w": make((6, 50)).astype(np.float32), "b": make((5,)).astype(np.float32)},
          {"w": rng.standard_normal((M, 6, 50)).astype(np.float32),
           "b": rng.standard_normal((M, 5)).astype(np.float32)})


@pytest.mark.parametrize("chunk_size,top_k,bits", [(64, 8, 1), (64, 8, 2), (16, 16, 2)])
def test_one_round_equals_the_numpy_oracle(chunk_size, top_k, bits):
  compressor = codecs.TopKCompressor(chunk_size, top_k, bits)
  x_R, e_R = _tree_R(seed=bits + chunk_size)
  mean_R, residual_R = jax.device_get(_vmapped_round(x_R, e_R, compressor))
  for name in x_R:
    mean, mean_bound, residual, residual_bound = _oracle_round(x_R[name], e_R[name], compressor)
    assert np.all(mean_R[name] == mean_R[name][0]), name  # the same mean on every worker
    error = np.abs(mean_R[name][0] - mean)
    assert np.all(error <= mean_bound), (name, float((error - mean_bound).max()))
    error = np.abs(residual_R[name] - residual)
    assert np.all(error <= residual_bound), (name, float((error - residual_bound).max()))
    # Entries no worker kept are exactly zero in the mean and exactly β·e + Δ in the residual.
    assert np.array_equal(mean_R[name][0] == 0, mean == 0), name
  if top_k == chunk_size:  # every value is kept: dense, only quantized
    assert np.all(np.asarray(mean_R["w"][0]) != 0)
  else:  # k of every chunk of c, per worker: at most M·k nonzeros per chunk in the mean
    nonzero = np.count_nonzero(mean_R["w"][0].reshape(-1)[:256].reshape(4, chunk_size), axis=1)
    assert np.all(nonzero <= M * top_k) and np.all(nonzero >= top_k)


def test_ties_and_zero_chunks_bit_exact():
  # Multiples of 1/4 in [-3/4, 3/4]: magnitudes repeat (ties everywhere), and with one bit, k = 4
  # and M = 4 every level (a sum of 4 magnitudes / 4), sum over workers and division is exact, so
  # the result must equal the oracle bit for bit. Worker 1's second chunk is all zeros.
  rng = np.random.default_rng(7)
  x_R = (rng.integers(-3, 4, (M, 4, 16)) / 4).astype(np.float32)
  x_R[1].reshape(-1)[8:16] = 0.0
  e_R = (rng.integers(-3, 4, (M, 4, 16)) / 8).astype(np.float32)
  e_R[1].reshape(-1)[8:16] = 0.0
  compressor = codecs.TopKCompressor(chunk_size=8, top_k=4, bits=1)
  mean_R, residual_R = jax.device_get(_vmapped_round(x_R, e_R, compressor))
  mean, _, residual, _ = _oracle_round(x_R, e_R, compressor)
  assert np.array_equal(mean_R[0], mean.astype(np.float32))
  assert np.array_equal(residual_R, residual.astype(np.float32))
  assert np.all(np.isfinite(mean_R)) and np.all(np.isfinite(residual_R))
  # The zero chunk sends four zeros (positions 0..3 by the tie rule) at level 0 and keeps zeros.
  assert np.all(residual_R[1].reshape(-1)[8:16] == 0)


def _roundtrip(compressor, x):
  """(positions, values) of the payload, the decoded tensor and the levels, in one program."""
  @jax.jit
  def run(x):
    parts = compressor.encode(x)
    return compressor.decode_sparse(*parts, x.size), compressor.decode(*parts, x.shape), parts[2]
  return jax.device_get(run(x))


@pytest.mark.parametrize("bits", [1, 2])
def test_ties_keep_the_lowest_index(bits):
  compressor = codecs.TopKCompressor(chunk_size=8, top_k=3, bits=bits)
  x = jnp.asarray([1.0, -2.0, 2.0, 0.5, -2.0, 2.0, 0.0, 1.0,   # |2| four times: keep 1, 2, 4
                   0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,     # zeros: keep 8, 9, 10
                   3.0, 3.0])                                   # short last chunk: both kept
  (positions, values), dense, _ = _roundtrip(compressor, x)
  # The last chunk pads 6 values, which rank below every real one: the first padding (18) is kept.
  assert positions.tolist() == [[1, 2, 4], [8, 9, 10], [16, 17, 18]]
  assert values[0].tolist() == [-2.0, 2.0, -2.0] and values[1].tolist() == [0.0, 0.0, 0.0]
  assert values[2][:2].tolist() == [3.0, 3.0]  # the padding is left out of the level
  assert dense.tolist() == [0, -2, 2, 0, -2, 0, 0, 0] + [0] * 8 + [3, 3]


def test_levels_of_the_two_bit_quantizer():
  # Kept magnitudes 8, 6, 2, 1 (k = 4 of 6): the bin edge is (8 + 1) / 2 = 4.5, the high bin
  # {8, 6} decodes to 7, the low bin {2, 1} to 1.5; signs are kept.
  compressor = codecs.TopKCompressor(chunk_size=6, top_k=4, bits=2)
  x = jnp.asarray([-8.0, 0.5, 6.0, -1.0, 2.0, 0.25])
  _, dense, scales = _roundtrip(compressor, x)
  assert scales.tolist() == [[1.5, 7.0]]
  assert dense.tolist() == [-7, 0, 7, -1.5, 1.5, 0]
  _, dense, scales = _roundtrip(codecs.TopKCompressor(chunk_size=6, top_k=4, bits=1), x)
  assert scales.tolist() == [[4.25]] and dense.tolist() == [-4.25, 0, 4.25, -4.25, 4.25, 0]


def test_a_nan_is_sent_not_dropped():
  # NaN ranks above every number in top-k, so it reaches the mean (its chunk's level is NaN)
  # instead of hiding in one worker's residual.
  x_R = np.ones((M, 16), np.float32)
  x_R[2, 3] = np.nan
  compressor = codecs.TopKCompressor(chunk_size=8, top_k=2, bits=2)
  mean = np.asarray(jax.jit(jax.vmap(lambda x: comm.sparse_mean(x, "replica", compressor),
                                     axis_name="replica"))(x_R))[0]
  assert np.isnan(mean[3]) and np.all(np.isfinite(mean[8:]))


@pytest.mark.parametrize("kwargs,option,allowed", [
    ({"chunk_size": 64, "top_k": 65}, "sparseloco.top_k", "[1, sparseloco.chunk_size = 64]"),
    ({"chunk_size": 64, "top_k": 0}, "sparseloco.top_k", "[1, sparseloco.chunk_size = 64]"),
    ({"chunk_size": 1, "top_k": 1}, "sparseloco.chunk_size", ">= 2"),
    ({"chunk_size": 64, "top_k": 8, "bits": 3}, "sparseloco.bits", "1 or 2"),
    ({"chunk_size": 64.0, "top_k": 8}, "sparseloco.chunk_size", ">= 2"),
])
def test_bad_settings_are_refused_in_one_line(kwargs, option, allowed):
  with pytest.raises(ValueError) as info:
    codecs.TopKCompressor(**kwargs)
  message = str(info.value)
  assert "\n" not in message and message.startswith(option) and allowed in message


def test_pack_bits_layout_and_roundtrip():
  # LSB first, no gap: codes 1, 2, 3 of 2 bits are 0b11_10_01 = 57; 12-bit 0xABC, 0x123 are the
  # bytes 0xBC, 0x3A, 0x12.
  assert packing.pack_bits(jnp.asarray([1, 2, 3]), 2).tolist() == [57]
  assert packing.pack_bits(jnp.asarray([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]
  rng = np.random.default_rng(0)
  for width in (1, 2, 3, 7, 12, 13):
    codes = rng.integers(0, 1 << width, 37)
    packed, unpacked = jax.jit(lambda c, w=width: (
        packing.pack_bits(c, w), packing.unpack_bits(packing.pack_bits(c, w), w, 37)))(codes)
    assert packed.dtype == jnp.uint8 and packed.size == packing.packed_bytes(37, width)
    assert np.array_equal(unpacked, codes)


def test_wire_bytes_are_the_encoded_bytes():
  for chunk_size, top_k, bits in ((4096, 64, 2), (64, 8, 1), (16, 16, 2), (2, 1, 1)):
    compressor = codecs.TopKCompressor(chunk_size, top_k, bits)
    for n in (1, 5, 63, 64, 65, 1000, 4097):
      encoded = jax.eval_shape(compressor.encode, jax.ShapeDtypeStruct((n,), jnp.float32))
      assert compressor.wire_bytes(n) == sum(part.size * part.dtype.itemsize for part in encoded), (
          chunk_size, n)
  # The paper's setting: per chunk of 4096 values, 64 positions of 12 bits (96 bytes), 64 codes of
  # 2 bits (16 bytes) and 2 float32 levels (8 bytes), against 16384 bytes in float32.
  paper = codecs.TopKCompressor(4096, 64, 2)
  assert paper.wire_bytes(4096) == 120 and paper.wire_bytes(10 * 4096) == 1200


def _mesh():
  return jax.make_mesh((M,), ("replica",), devices=jax.devices()[:M],
                       axis_types=(AxisType.Auto,))


def _on_mesh(compressor, mesh):
  def body(t, e):
    mean, residual = comm.sparse_mean(jax.tree.map(lambda a: a[0], t), "replica", compressor,
                                      residual=jax.tree.map(lambda a: a[0], e), decay=DECAY)
    return mean, jax.tree.map(lambda a: a[None], residual)
  # out_specs P() for the mean: it is typed as the same on every worker.
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("replica"),
                               out_specs=(P(), P("replica"))))


def test_shard_map_equals_vmap_bit_for_bit():
  compressor = codecs.TopKCompressor(64, 8, 2)
  x_R, e_R = _tree_R(seed=11)
  mesh = _mesh()
  put = lambda t: jax.device_put(t, NamedSharding(mesh, P("replica")))
  mean, residual = jax.device_get(_on_mesh(compressor, mesh)(put(x_R), put(e_R)))
  mean_R, residual_R = jax.device_get(_vmapped_round(x_R, e_R, compressor))
  for name in x_R:
    assert np.array_equal(mean[name], mean_R[name][0]), name
    assert np.array_equal(residual[name], residual_R[name]), name


def test_the_syncers_wire_format_equals_the_collective_bit_for_bit():
  """An elastic run's exchange (`comm.remote`: each learner encodes with its residual, the syncer
  decodes and averages) against `comm.sparse_mean` over a replica axis, two rounds, each learner's
  residual carried from the first to the second: the same mean and residuals, bit for bit (β·e + Δ
  is one rounding in both; the payloads, their levels and the worker-ordered sum are the same
  float32 operations)."""
  from lowcomm_jax.comm import remote  # pylint: disable=g-import-not-at-top
  compressor = codecs.TopKCompressor(64, 8, 2)
  plan = comm.Plan("sparse_gather", compressor, error_feedback=True, feedback_decay=DECAY)
  x_R, e_R = _tree_R(seed=5)
  second_R, _ = _tree_R(seed=6)
  worker = lambda t, r: jax.tree.map(lambda a: np.asarray(a[r]), t)
  residuals = [worker(e_R, r) for r in range(M)]
  for x in (x_R, second_R):
    mean_R, residual_R = jax.device_get(_vmapped_round(x, e_R, compressor))
    sent = [remote.encode(plan, "outer", worker(x, r), residuals[r]) for r in range(M)]
    mean = remote.mean([remote.decode(plan, payload) for payload, _ in sent], [1.0] * M)
    residuals = [residual for _, residual in sent]
    for name in x:
      assert np.array_equal(mean[name], mean_R[name][0]), name
      assert np.array_equal(np.stack([r[name] for r in residuals]), residual_R[name]), name
    e_R = residual_R
  # not vacuous: the second round's mean is not what its Δ alone would send (the residual counted)
  alone = jax.device_get(_vmapped_round(second_R, jax.tree.map(np.zeros_like, e_R), compressor))
  assert not np.array_equal(mean["w"], alone[0]["w"][0])


_RESULT = re.compile(r"= (\w+)\[([\d,]*)\]")


def test_ledger_bytes_equal_the_compiled_all_gathers():
  compressor = codecs.TopKCompressor(64, 8, 2)
  x_R, e_R = _tree_R(seed=0)
  mesh = _mesh()
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                        sharding=NamedSharding(mesh, P("replica")))
  with comm.Ledger().recording() as ledger:
    lowered = _on_mesh(compressor, mesh).lower(jax.tree.map(spec, x_R), jax.tree.map(spec, e_R))
  lines = hlo.collectives(lowered.compile().as_text())
  assert all(" all-gather(" in line for line in lines), lines  # no dense all-reduce, nothing else
  # Three all-gathers for the whole tree: packed positions, packed codes, levels; each result is
  # [M, the two leaves' parts laid end to end].
  layouts = [compressor.layout(x.size // M) for x in (x_R["b"], x_R["w"])]
  expected = sorted([
      ("u8", (M, sum(packing.packed_bytes(c * k, b) for c, _, k, b in layouts))),
      ("u8", (M, sum(packing.packed_bytes(c * k, 2) for c, _, k, _ in layouts))),
      ("f32", (M, sum(c * 2 for c, _, _, _ in layouts)))])
  shapes = sorted((dtype, tuple(int(d) for d in dims.split(",")))
                  for dtype, dims in (_RESULT.search(line).groups() for line in lines))
  assert shapes == expected
  [entry] = ledger.entries
  assert entry.kind == "all_gather" and entry.num_workers == M
  assert entry.payload_bytes == sum(map(collective_bytes, lines)) // M
  assert entry.payload_bytes == sum(compressor.wire_bytes(x.size // M) for x in x_R.values())
  assert entry.sent_bytes == (M - 1) * entry.payload_bytes


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_for_accelerators(platform):
  compressor = codecs.TopKCompressor(64, 8, 2)
  x_R, e_R = _tree_R(seed=0)
  mesh = _mesh()
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                        sharding=NamedSharding(mesh, P("replica")))
  text = _on_mesh(compressor, mesh).trace(jax.tree.map(spec, x_R), jax.tree.map(spec, e_R)).lower(
      lowering_platforms=(platform,)).as_text()
  assert text.count('"stablehlo.all_gather"') == 3 and "all_reduce" not in text


def test_selection_compiles_to_top_k_not_a_full_sort():
  # XLA runs top_k as its TopK kernel only while nothing but top_k reads the sort behind it; a full
  # sort of every chunk instead is an order of magnitude slower. The whole exchange keeps it.
  compressor = codecs.TopKCompressor(64, 8, 2)
  x = jax.ShapeDtypeStruct((M, 1000), jnp.float32)
  text = jax.jit(jax.vmap(lambda t: comm.sparse_mean(t, "replica", compressor, residual=t),
                          axis_name="replica")).lower(x).compile().as_text()
  assert 'custom_call_target="TopK"' in text and " sort(" not in text
