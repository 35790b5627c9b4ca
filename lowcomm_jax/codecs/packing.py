"""Two 4-bit codes per byte.

Within each block (a row of ``L`` codes, ``L`` even) byte ``j`` holds code
``j`` in its low nibble and code ``j + L/2`` in its high nibble. Pairing the
two halves of a row, rather than neighbours, lets a kernel read and write the
halves as two contiguous slices of its refs (no strided access, no value
slicing or concatenation), and the byte count is the same: ``L/2`` bytes per
block, so ``2^k`` codes take exactly ``2^(k-1)`` bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["pack_pair", "unpack_pair", "pack_nibbles", "unpack_nibbles"]


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
