"""Two 4-bit codes per byte.

Within each block (a row of ``L`` codes, ``L`` even) byte ``j`` holds code
``j`` in its low nibble and code ``j + L/2`` in its high nibble. Pairing the
two halves of a row, rather than neighbours, needs only two contiguous slices
in a kernel (no strided access), and the byte count is the same: ``L/2``
bytes per block, so ``2^k`` codes take exactly ``2^(k-1)`` bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["pack_nibbles", "unpack_nibbles"]


def pack_nibbles(codes: jax.Array) -> jax.Array:
  """Packs uint8 codes in [0, 16) of shape ``[B, L]`` (L even) into ``[B, L/2]`` bytes."""
  half = codes.shape[-1] // 2
  low, high = codes[..., :half], codes[..., half:]
  return (low | (high << 4)).astype(jnp.uint8)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """Inverse of :func:`pack_nibbles`: ``[B, L/2]`` bytes to ``[B, L]`` codes."""
  return jnp.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(jnp.uint8)
