"""Symmetric integer codecs: ``int4`` and ``int8`` with an absmax scale per block.

``int4`` is sign-magnitude over the integers 0..7 (the two's-complement -8 is
left out so the range is symmetric); it is a :class:`~fourbit.GridCodec` with
the grid 0, 1, ..., 7 and ``scale = absmax / 7``. ``int8`` stores
``round(x / scale)`` in [-127, 127] as two's-complement int8 with
``scale = absmax / 127`` (-128 unused, for the same symmetry). Ties round to
even, as ``jnp.round`` does (computed from the integer part); stochastic rounding rounds up with
probability equal to the fractional part.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from lowcomm_jax.codecs import base, fourbit

__all__ = ["INT4", "INT8", "INT4_GRID", "INT8_MAX"]

INT4_GRID = tuple(float(level) for level in range(8))
INT8_MAX = 127.0


@dataclasses.dataclass(frozen=True)
class INT4(fourbit.GridCodec):
  """Symmetric 4-bit integers, sign-magnitude, ``absmax / 7`` scale per block."""

  name: ClassVar[str] = "int4"
  grid: ClassVar[tuple[float, ...]] = INT4_GRID


def _floor(magnitude: jax.Array) -> jax.Array:
  """``jnp.floor`` of values in [0, 2^31) as the integer part (truncation is floor there); Pallas
  Mosaic GPU has no rule for ``floor``."""
  return magnitude.astype(jnp.int32).astype(jnp.float32)


def _round_half_even(magnitude: jax.Array) -> jax.Array:
  """``jnp.round`` of values in [0, 2^31), from the integer part (Triton has no rule for
  ``round``)."""
  whole = magnitude.astype(jnp.int32)
  floor = whole.astype(jnp.float32)
  fraction = magnitude - floor  # exact for floats
  odd = (whole & 1) == 1
  up = (fraction > 0.5) | ((fraction == 0.5) & odd)
  return floor + up.astype(jnp.float32)


def _encode_int8_values(x: jax.Array, divisor: jax.Array, finite: jax.Array,
                        bits: jax.Array | None) -> jax.Array:
  """fp32 ``[R, n]`` to int8 ``[R, n]``."""
  magnitude = jnp.where(finite, jnp.minimum(jnp.abs(x) / divisor, INT8_MAX), 0.0)
  if bits is None:
    level = _round_half_even(magnitude)
  else:
    floor = _floor(magnitude)
    level = floor + (base.uniform_from_bits(bits) < magnitude - floor).astype(jnp.float32)
  level = jnp.minimum(level, INT8_MAX)
  return jnp.where(x < 0, -level, level).astype(jnp.int32).astype(jnp.int8)


@dataclasses.dataclass(frozen=True)
class INT8(base.Codec):
  """Symmetric 8-bit integers, ``absmax / 127`` scale per block."""

  name: ClassVar[str] = "int8"
  bits_per_value: ClassVar[int] = 8
  code_dtype: ClassVar[Any] = jnp.int8
  grid_max: ClassVar[float] = INT8_MAX

  def encode_values(self, x, divisor, finite, bits):
    return _encode_int8_values(x, divisor, finite, bits)

  def decode_values(self, codes, scale):
    return codes.astype(jnp.int32).astype(jnp.float32) * scale
