"""A block's scale from its largest magnitude: what the reference codecs and the kernels share."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def scales_from_absmax(absmax: jax.Array, grid_max: float):
  """``(scale, divisor, finite)`` of blocks whose largest magnitude is ``absmax``.

  The scale is NaN for a block holding NaN or inf (the NaN and inf policy of `codecs.base`),
  and the divisor is the scale where that is safe to divide by and 1 for an
  all-zero (or flushed) block, whose values then all code to zero.
  """
  finite = absmax < jnp.inf  # isfinite of a magnitude (no rule for is_finite in Mosaic GPU)
  scale = jnp.where(finite, absmax / grid_max, jnp.nan)
  divisor = jnp.where(finite & (scale > 0), scale, 1.0)
  return scale, divisor, finite
