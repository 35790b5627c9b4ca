"""Error feedback: resend what quantization dropped last time.

Before encoding, the residual kept from the previous round is added to the new
outer gradient; after encoding, the new residual is what the receivers did not
get: ``residual = corrected - decode(encode(corrected))``. Over rounds the
errors then cancel instead of accumulating, while the residual itself stays
within one quantization error of the latest input. Streaming DiLoCo keeps one
state per replica and per fragment; the state is a NamedTuple of fp32 arrays,
so it checkpoints like any optimizer state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lowcomm_jax.codecs import base
from lowcomm_jax.codecs import replica_mean

__all__ = [
    "ErrorFeedbackState",
    "init_error_feedback",
    "error_feedback_roundtrip",
    "compressed_mean_with_error_feedback",
]


class ErrorFeedbackState(NamedTuple):
  """Per-replica quantization residual, fp32, same structure as the gradient."""

  residual: Any


def init_error_feedback(tree: Any) -> ErrorFeedbackState:
  """Zero residuals shaped like ``tree`` (arrays or ShapeDtypeStructs)."""
  return ErrorFeedbackState(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree))


def _add_residual(tree: Any, state: ErrorFeedbackState) -> Any:
  return jax.tree.map(lambda g, r: g.astype(jnp.float32) + r, tree, state.residual)


def error_feedback_roundtrip(tree: Any, state: ErrorFeedbackState, codec: base.Codec,
                             key: jax.Array | None = None, **kernel_options):
  """Encodes ``tree + residual`` and decodes it, as a point-to-point send would.

  Args:
    tree: the new outer gradient (array or pytree).
    state: the residual from the previous round.
    codec: the codec.
    key: PRNG key for stochastic rounding.
    **kernel_options: ``use_pallas``, ``interpret``, ``rows_per_step``.

  Returns:
    ``(decoded, new_state)``: what the receiver gets, and the residual
    ``corrected - decoded``.
  """
  corrected = _add_residual(tree, state)
  leaves, treedef = jax.tree.flatten(corrected)
  keys = [None] * len(leaves) if key is None else list(jax.random.split(key, max(len(leaves), 1)))
  decoded = jax.tree.unflatten(
      treedef, [codec.roundtrip(leaf, leaf_key, **kernel_options)
                for leaf, leaf_key in zip(leaves, keys)])
  residual = jax.tree.map(jnp.subtract, corrected, decoded)
  return decoded, ErrorFeedbackState(residual)


def compressed_mean_with_error_feedback(tree: Any, state: ErrorFeedbackState, axis_name,
                                        codec: base.Codec, axis_size: int | None = None, *,
                                        key: jax.Array | None = None, **kernel_options):
  """:func:`~lowcomm_jax.codecs.compressed_mean` of ``tree + residual``.

  The residual covers the local (sending) quantization, computed on exactly
  the chunks and blocks the mean encodes; the re-quantization of the mean by
  the chunk's owner is shared by all replicas and is not fed back.

  Returns:
    ``(mean, new_state)``.
  """
  corrected = _add_residual(tree, state)
  mean, residual = replica_mean.compressed_mean(
      corrected, axis_name, codec, axis_size, key=key, return_residual=True, **kernel_options)
  return mean, ErrorFeedbackState(residual)
