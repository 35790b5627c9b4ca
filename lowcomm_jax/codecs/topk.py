"""Chunked top-k sparsification with 1- or 2-bit values: SparseLoCo's wire format.

SparseLoCo (Sarfi et al., arXiv 2508.15706) sends, per worker and per outer
step, only the ``k`` largest-magnitude entries of every chunk of its
error-feedback buffer, each value quantized to 2 bits. This module encodes one
tensor into that payload and decodes it; the exchange over the replica axis is
``lowcomm_jax.comm.sparse_mean``.

Chunks. The tensor is flattened and cut into ``C = ceil(n / c)`` chunks of
``c = min(chunk_size, n)`` values, the last one padded (padding is never
preferred to a real value and never reaches the output). ``k = min(top_k, c)``
entries are kept per chunk: a tensor smaller than one chunk is one chunk of
its own size, so a 64-value norm scale is sent whole rather than padded to
``chunk_size``. Ties in ``|x|`` are broken by position, lowest index first
(``lax.top_k``'s documented order), on every platform.

Quantizer (``bits`` = b). The sign of every kept value is sent exactly; its
magnitude is one of ``L = 2^(b−1)`` levels of its chunk. With b = 1 the level
is the mean kept magnitude (a scaled sign, L2-optimal for one level). With
b = 2 the kept magnitudes, which lie in ``[a_min, a_max]``, are split at the
midpoint ``(a_min + a_max) / 2`` into a low and a high bin, and each bin is
reconstructed as the mean magnitude of the values in it. Reconstructing a bin
by the mean of its members is the bin-mean lookup of the paper's reference
quantizer; the bins here are sign-symmetric, as top-k values are: they are
never near zero, so no code is spent on a zero level. The ``L`` float32
levels of a chunk are its scales. An empty bin has level 0; a chunk of zeros
decodes to zeros (no division by zero).

Wire format of one tensor (``encode``), all counted by ``wire_bytes``:

- indices: the ``C·k`` in-chunk positions, ``ceil(log2 c)`` bits each
  (12 bits for c = 4096), bit-packed with no gap
  (:func:`~lowcomm_jax.codecs.packing.pack_bits`), chunk after chunk, in
  top-k order: ``ceil(C·k·ceil(log2 c) / 8)`` bytes;
- codes: ``C·k`` codes of b bits, ``code = 2·bin + (value < 0)``, packed
  ``8 / b`` per byte: ``ceil(C·k·b / 8)`` bytes;
- scales: float32 ``[C, L]``: ``4·C·L`` bytes.

At the paper's setting (c = 4096, k = 64, b = 2) a chunk of 4096 values
(16 KiB in float32) travels as 96 + 16 + 8 = 120 bytes.

Example:
  >>> import jax.numpy as jnp
  >>> compressor = TopKCompressor(chunk_size=4, top_k=2, bits=1)
  >>> x = jnp.array([0.5, -3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0])
  >>> compressor.decode(*compressor.encode(x), x.shape).tolist()
  [0.0, -2.5, 0.0, 2.5, 0.0, 0.0, 0.0, 0.0]
  >>> compressor.wire_bytes(8)  # 4 indices of 2 bits, 4 codes of 1 bit, 2 scales
  10
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from lowcomm_jax import checks
from lowcomm_jax.codecs import packing

__all__ = ["SparseLayout", "TopKCompressor"]


class SparseLayout(NamedTuple):
  """How a tensor of ``n`` values is cut: ``num_chunks`` chunks of ``chunk_len``, ``k`` kept in
  each, each position sent in ``index_bits`` bits."""

  num_chunks: int
  chunk_len: int
  k: int
  index_bits: int


@dataclasses.dataclass(frozen=True)
class TopKCompressor:
  """Chunked top-k with b-bit values and per-chunk levels (see the module docstring).

  Attributes:
    chunk_size: values per chunk, c ≥ 2 (the paper: 4096).
    top_k: values kept per chunk, 1 ≤ k ≤ c (the paper: 64, a density of 1.56 %).
    bits: bits per kept value, 1 or 2 (the paper: 2).
  """

  chunk_size: int = 4096
  top_k: int = 64
  bits: int = 2

  def __post_init__(self):
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    checks.require(is_int(self.chunk_size) and self.chunk_size >= 2, "sparseloco.chunk_size",
                   "an integer >= 2", self.chunk_size)
    checks.require(is_int(self.top_k) and 1 <= self.top_k <= self.chunk_size, "sparseloco.top_k",
                   f"an integer in [1, sparseloco.chunk_size = {self.chunk_size}]", self.top_k)
    checks.require(self.bits in (1, 2) and is_int(self.bits), "sparseloco.bits", "1 or 2",
                   self.bits)

  @property
  def num_levels(self) -> int:
    """Magnitude levels per chunk, ``L = 2^(bits−1)``: the scales each chunk sends."""
    return 1 << (self.bits - 1)

  def layout(self, num_elements: int) -> SparseLayout:
    """The chunking of a tensor of ``num_elements`` values (static)."""
    chunk_len = max(1, min(self.chunk_size, num_elements))
    return SparseLayout(num_chunks=-(-num_elements // chunk_len), chunk_len=chunk_len,
                        k=min(self.top_k, chunk_len),
                        index_bits=max(1, (chunk_len - 1).bit_length()))

  def wire_bytes(self, num_elements: int) -> int:
    """Exact bytes of one encoded tensor of ``num_elements`` values: indices + codes + scales."""
    c, _, k, index_bits = self.layout(num_elements)
    return (packing.packed_bytes(c * k, index_bits) + packing.packed_bytes(c * k, self.bits)
            + 4 * c * self.num_levels)

  def encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One tensor to its payload.

    Args:
      x: an array of any shape and float dtype (read as float32).

    Returns:
      ``(indices, codes, scales)``: uint8 ``[ceil(C·k·index_bits / 8)]``, uint8
      ``[ceil(C·k·bits / 8)]`` and float32 ``[C, L]``.
    """
    n = x.size
    c, chunk_len, k, index_bits = self.layout(n)
    chunks = jnp.pad(x.reshape(-1).astype(jnp.float32), (0, c * chunk_len - n)).reshape(
      c, chunk_len
    )
    real = (jnp.arange(c * chunk_len) < n).reshape(c, chunk_len)
    # Padding ranks below every real magnitude (|x| ≥ 0), so it is kept only where a short last
    # chunk has fewer than k real values; it is then left out of the levels and never decoded.
    ranked, index = lax.top_k(jnp.where(real, jnp.abs(chunks), -1.0), k)
    value = jnp.take_along_axis(chunks, index, axis=1)
    kept = jnp.take_along_axis(real, index, axis=1)  # by position: a NaN is a real value
    magnitude = jnp.abs(value)
    if self.num_levels == 1:
      level_of = jnp.zeros((c, k), jnp.int32)
    else:
      # Reductions, not ranked[:, 0]: a slice of top_k's output besides its own keeps XLA from
      # rewriting the sort behind top_k into its TopK kernel (a full sort, ~20x slower on CPU).
      largest = jnp.max(ranked, axis=1)
      smallest = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=1)
      level_of = (magnitude >= ((largest + smallest) * 0.5)[:, None]).astype(jnp.int32)
    member = (level_of[..., None] == jnp.arange(self.num_levels)) & kept[..., None]  # [C, k, L]
    total = jnp.sum(jnp.where(member, magnitude[..., None], 0.0), axis=1)
    count = jnp.sum(member, axis=1)
    scales = jnp.where(count > 0, total / jnp.maximum(count, 1).astype(jnp.float32), 0.0)
    codes = 2 * level_of + (value < 0).astype(jnp.int32)
    return packing.pack_bits(index, index_bits), packing.pack_bits(codes, self.bits), scales

  def decode_sparse(self, indices: jax.Array, codes: jax.Array, scales: jax.Array,
                    num_elements: int) -> tuple[jax.Array, jax.Array]:
    """A payload to its kept entries: positions in the padded flat tensor and float32 values.

    Returns:
      ``(positions, values)``, int32 and float32 ``[C, k]``. Positions within one payload are
      distinct; those ``≥ num_elements`` are padding, to be dropped by the caller.
    """
    c, chunk_len, k, index_bits = self.layout(num_elements)
    index = packing.unpack_bits(indices, index_bits, c * k).reshape(c, k)
    code = packing.unpack_bits(codes, self.bits, c * k).reshape(c, k)
    magnitude = jnp.take_along_axis(scales, code >> 1, axis=1)
    values = jnp.where((code & 1) == 1, -magnitude, magnitude)
    return index + chunk_len * jnp.arange(c, dtype=jnp.int32)[:, None], values

  def decode(self, indices: jax.Array, codes: jax.Array, scales: jax.Array,
             shape: tuple[int, ...]) -> jax.Array:
    """A payload to the dense float32 tensor of ``shape`` (zeros where nothing was kept)."""
    n = 1
    for d in shape:
      n *= d
    c, chunk_len, _, _ = self.layout(n)
    positions, values = self.decode_sparse(indices, codes, scales, n)
    dense = jnp.zeros(c * chunk_len, jnp.float32).at[positions.reshape(-1)].set(
        values.reshape(-1), unique_indices=True)
    return dense[:n].reshape(shape)
