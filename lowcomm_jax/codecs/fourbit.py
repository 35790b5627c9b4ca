"""4-bit sign-magnitude codecs over a grid of 8 magnitudes, with Pallas kernels.

``e3m0``, ``e2m1`` and ``int4`` share one scheme: a code is a sign bit (bit 3)
and a 3-bit index into an increasing grid of 8 non-negative magnitudes ``g``
with ``g[0] = 0``; the value is ``±g[index] · scale`` with one fp32 scale per
block, ``scale = absmax / g[7]`` (so the block's largest value lands on the top
of the grid). Only the grid differs between the three formats. The code
``0b1000`` (negative zero) is never produced.

Rounding to nearest compares ``|x| / scale`` with the midpoints of the grid,
ties going to the even index (for ``e2m1`` this is IEEE round-half-to-even,
the same as ``ml_dtypes``' cast). Stochastic rounding picks the grid point
just below or just above with probability proportional to the distance to the
other, so the expected decode equals the input.

``_encode_values``/``_decode_values`` are the math of values given their
block's scale: the jnp reference applies it to whole blocks and the Pallas
kernels (:mod:`lowcomm_jax.codecs.kernels`) to the two halves of each block
of a tile (both through :class:`~lowcomm_jax.codecs.base.Codec`). Codes are
int32 until packed, so the kernels do no 8-bit arithmetic. Grid values enter
the kernels as Python floats (kernels may not capture arrays).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from lowcomm_jax.codecs import base

__all__ = ["GridCodec"]


def _select(index: jax.Array, table: tuple[float, ...]) -> jax.Array:
  """``table[index]`` as a chain of selects between Python constants."""
  out = jnp.full(index.shape, table[0], jnp.float32)
  for i, value in enumerate(table[1:], start=1):
    out = jnp.where(index == i, jnp.float32(value), out)
  return out


def _grid_index(magnitude: jax.Array, uniform: jax.Array | None,
                grid: tuple[float, ...]) -> jax.Array:
  """Index into ``grid`` of ``magnitude`` (already in grid units, ≤ grid[-1])."""
  if uniform is None:
    index = jnp.zeros(magnitude.shape, jnp.int32)
    for k in range(len(grid) - 1):
      midpoint = (grid[k] + grid[k + 1]) / 2
      # A tie moves up only when the upper neighbour has the even index.
      above = magnitude >= midpoint if k % 2 else magnitude > midpoint
      index = index + above.astype(jnp.int32)
    return index
  lower = jnp.zeros(magnitude.shape, jnp.int32)
  for k in range(1, len(grid)):
    lower = lower + (magnitude >= grid[k]).astype(jnp.int32)
  lower_value = _select(lower, grid)
  upper_value = _select(jnp.minimum(lower + 1, len(grid) - 1), grid)
  gap = upper_value - lower_value
  prob_up = jnp.where(gap > 0, (magnitude - lower_value) / jnp.where(gap > 0, gap, 1.0), 0.0)
  return lower + (uniform < prob_up).astype(jnp.int32)


def _encode_values(x: jax.Array, divisor: jax.Array, finite: jax.Array,
                   bits: jax.Array | None, grid: tuple[float, ...]) -> jax.Array:
  """fp32 ``[R, n]`` to int32 codes in [0, 16) (sign bit 3, grid index bits 0-2)."""
  grid_max = grid[-1]
  magnitude = jnp.where(finite, jnp.minimum(jnp.abs(x) / divisor, grid_max), 0.0)
  uniform = None if bits is None else base.uniform_from_bits(bits)
  index = _grid_index(magnitude, uniform, grid)
  negative = (x < 0) & (index > 0)
  return index | (negative.astype(jnp.int32) << 3)


def _decode_values(codes: jax.Array, scale: jax.Array, grid: tuple[float, ...]) -> jax.Array:
  """Integer codes ``[R, n]`` and scales ``[R, 1]`` to fp32 ``[R, n]``."""
  magnitude = _select(codes & 0x7, grid) * scale
  return jnp.where((codes >> 3) == 1, -magnitude, magnitude)


@dataclasses.dataclass(frozen=True)
class GridCodec(base.Codec):
  """A 4-bit codec defined by its 8 magnitudes; subclasses set ``grid``."""

  bits_per_value: ClassVar[int] = 4
  code_dtype: ClassVar[Any] = jnp.uint8
  grid: ClassVar[tuple[float, ...]]

  @property
  def grid_max(self) -> float:
    return self.grid[-1]

  def encode_values(self, x, divisor, finite, bits):
    return _encode_values(x, divisor, finite, bits, self.grid)

  def decode_values(self, codes, scale):
    return _decode_values(codes, scale, self.grid)
