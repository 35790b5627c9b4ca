"""The 4-bit float formats: ``e3m0`` (Streaming DiLoCo's FP4) and ``e2m1`` (OCP FP4).

``e3m0``: a sign bit and 3 exponent bits, no mantissa, so every nonzero value
is ``±absmax · 2^e``. We spend exponent code 0 on zero (outer gradients have
exact zeros, and the padding must decode to zero) and give codes 1..7 the
exponents e = -6..0:

    magnitudes / absmax = 0, 1/64, 1/32, 1/16, 1/8, 1/4, 1/2, 1

with the block's absmax as the scale (the top of the grid is 1). Values below
``absmax / 128`` round to zero; nearest rounding is in the linear domain
(midpoints 1/128, 3/128, 3/64, ..., 3/4), which minimizes the squared error.

``e2m1``: the OCP microscaling FP4, ``ml_dtypes.float4_e2m1fn``: magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6 times ``absmax / 6``. The 3-bit index here equals
the format's exponent-mantissa bits, so a code is bit-for-bit the
``float4_e2m1fn`` encoding of ``x / scale``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lowcomm_jax.codecs import fourbit

__all__ = ["E3M0", "E2M1", "E3M0_GRID", "E2M1_GRID"]

E3M0_GRID = (0.0,) + tuple(2.0**exponent for exponent in range(-6, 1))
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclasses.dataclass(frozen=True)
class E3M0(fourbit.GridCodec):
  """Sign + 3 exponent bits; zero coded by exponent code 0; absmax scale per block."""

  name: ClassVar[str] = "e3m0"
  grid: ClassVar[tuple[float, ...]] = E3M0_GRID


@dataclasses.dataclass(frozen=True)
class E2M1(fourbit.GridCodec):
  """OCP FP4 (``float4_e2m1fn``) with an ``absmax / 6`` scale per block."""

  name: ClassVar[str] = "e2m1"
  grid: ClassVar[tuple[float, ...]] = E2M1_GRID
