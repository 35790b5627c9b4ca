"""Unscaled codecs: ``bf16`` (half the bytes) and ``fp32`` (the exact baseline).

Both ignore ``block_size``: the tensor is one unpadded block and there are no
scales, so the wire carries exactly 2 or 4 bytes per value. NaN and ±inf pass
through value by value (bf16 has the same exponent range as fp32). ``bf16``
rounds to nearest-even, or stochastically by adding 16 random bits below the
kept mantissa and truncating, which rounds up with probability equal to the
dropped fraction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from lowcomm_jax.codecs import base

__all__ = ["BF16", "FP32"]


def _bf16_tile(x: jax.Array, bits: jax.Array | None) -> jax.Array:
  if bits is None:
    return x.astype(jnp.bfloat16)
  raw = lax.bitcast_convert_type(x, jnp.uint32)
  # Adding below the cut and truncating rounds the magnitude up with the
  # probability of the dropped fraction; NaN/inf keep their exact pattern.
  rounded = (raw + (bits & 0xFFFF)) & jnp.uint32(0xFFFF0000)
  stochastic = lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
  return jnp.where(jnp.isfinite(x), stochastic, x.astype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class _Unscaled(base.Codec):
  """One unpadded block, no scales: block_size has no effect."""

  has_scales: ClassVar[bool] = False
  single_block: ClassVar[bool] = True


@dataclasses.dataclass(frozen=True)
class BF16(_Unscaled):
  """bfloat16 values, no scales."""

  name: ClassVar[str] = "bf16"
  bits_per_value: ClassVar[int] = 16
  code_dtype: ClassVar[Any] = jnp.bfloat16

  def encode_values(self, x, divisor, finite, bits):
    del divisor, finite  # bf16 carries no scales
    return _bf16_tile(x, bits)

  def decode_values(self, codes, scale):
    del scale
    return codes.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class FP32(_Unscaled):
  """float32 values as they are: the lossless baseline (rounding has no effect)."""

  name: ClassVar[str] = "fp32"
  bits_per_value: ClassVar[int] = 32
  code_dtype: ClassVar[Any] = jnp.float32

  def random_bits(self, key, shape):
    del key, shape  # lossless: nothing to round, so no key is needed
    return None

  def encode_values(self, x, divisor, finite, bits):
    del divisor, finite, bits
    return x

  def decode_values(self, codes, scale):
    del scale
    return codes
