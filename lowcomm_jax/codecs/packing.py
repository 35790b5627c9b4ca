"""Packing integer codes into bytes: two 4-bit codes per byte, and codes of any width.

Within each block (a row of ``L`` codes, ``L`` even) byte ``j`` holds code
``j`` in its low nibble and code ``j + L/2`` in its high nibble. Pairing the
two halves of a row, rather than neighbours, lets a kernel read and write the
halves as two contiguous slices of its refs (no strided access, no value
slicing or concatenation), and the byte count is the same: ``L/2`` bytes per
block, so ``2^k`` codes take exactly ``2^(k-1)`` bytes.

:func:`pack_bits` packs a stream of ``w``-bit codes (``w`` from 1 to 31) into
``ceil(n·w / 8)`` bytes with no gap between codes: code ``i`` occupies bits
``i·w`` to ``i·w + w − 1`` of the stream, least significant bit first, and
bit ``j`` of the stream is bit ``j mod 8`` of byte ``j div 8``. The sparse
wire format (``codecs.topk``) sends its 12-bit indices and 2-bit values so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["pack_pair", "unpack_pair", "pack_nibbles", "unpack_nibbles", "pack_bits", "unpack_bits",
           "packed_bytes"]


def pack_pair(low: jax.Array, high: jax.Array) -> jax.Array:
  """Integer codes in [0, 16), two equal shapes, to the bytes ``low | high << 4``."""
  return (low.astype(jnp.int32) | (high.astype(jnp.int32) << 4)).astype(jnp.uint8)


def unpack_pair(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inverse of :func:`pack_pair`: the low and high codes as int32."""
  wide = packed.astype(jnp.int32)
  return wide & 0xF, wide >> 4


def pack_nibbles(codes: jax.Array) -> jax.Array:
  """Packs integer codes in [0, 16) of shape ``[B, L]`` (L even) into ``[B, L/2]`` bytes."""
  half = codes.shape[-1] // 2
  return pack_pair(codes[..., :half], codes[..., half:])


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """Inverse of :func:`pack_nibbles`: ``[B, L/2]`` bytes to ``[B, L]`` int32 codes."""
  return jnp.concatenate(unpack_pair(packed), axis=-1)


def packed_bytes(count: int, width: int) -> int:
  """Bytes :func:`pack_bits` gives for ``count`` codes of ``width`` bits: ``ceil(count·width /
  8)``."""
  return -(-count * width // 8)


def pack_bits(codes: jax.Array, width: int) -> jax.Array:
  """Integer codes in ``[0, 2^width)`` (any shape, read flattened) to a uint8 stream, LSB first."""
  flat = codes.reshape(-1).astype(jnp.uint32)
  bits = ((flat[:, None] >> jnp.arange(width, dtype=jnp.uint32)) & 1).astype(jnp.uint8).reshape(-1)
  bits = jnp.pad(bits, (0, (-bits.size) % 8))
  # The eight bits of a byte are distinct powers of two, so their sum is their bitwise or.
  return jnp.sum(bits.reshape(-1, 8) << jnp.arange(8, dtype=jnp.uint8), axis=1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array, width: int, count: int) -> jax.Array:
  """Inverse of :func:`pack_bits`: the first ``count`` codes of the stream, as int32 ``[count]``."""
  bits = (packed[:, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
  bits = bits.reshape(-1)[:count * width].reshape(count, width).astype(jnp.int32)
  return jnp.sum(bits << jnp.arange(width, dtype=jnp.int32), axis=1, dtype=jnp.int32)
