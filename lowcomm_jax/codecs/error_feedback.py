"""Error feedback: resend what quantization dropped last time.

Before encoding, the residual kept from the previous round is added to the new
outer gradient; after encoding, the new residual is what the receivers did not
get: ``residual = corrected - decode(encode(corrected))``. Over rounds the
errors then cancel instead of accumulating, while the residual itself stays
within one quantization error of the latest input. Streaming DiLoCo keeps one
state per replica and per fragment; the state is a NamedTuple of fp32 arrays,
so it checkpoints like any optimizer state.

:func:`with_error_feedback` is the one implementation, around any send: a
point-to-point roundtrip (:func:`error_feedback_roundtrip`) or the compressed
mean over the replica axis (``lowcomm_jax.comm.compressed_mean(..., residual=)``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from lowcomm_jax.codecs import base

__all__ = [
    "ErrorFeedbackState",
    "init_error_feedback",
    "with_error_feedback",
    "error_feedback_roundtrip",
]


class ErrorFeedbackState(NamedTuple):
  """Per-replica quantization residual, fp32, same structure as the gradient."""

  residual: Any


def init_error_feedback(tree: Any) -> ErrorFeedbackState:
  """Zero residuals shaped like ``tree`` (arrays or ShapeDtypeStructs)."""
  return ErrorFeedbackState(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree))


def with_error_feedback(send: Callable[[Any], tuple[Any, Any]], tree: Any, residual: Any):
  """Sends ``tree + residual`` and keeps what the encoding dropped.

  Args:
    send: ``corrected -> (result, sent)``, where ``sent`` is what the receivers get of this
      sender's ``corrected`` (its decoded encoding, with the send's own blocking).
    tree: the new outer gradient (array or pytree).
    residual: the previous residual (fp32, same structure).

  Returns:
    ``(result, new residual)`` with ``new residual = corrected − sent``.
  """
  corrected = jax.tree.map(lambda g, r: g.astype(jnp.float32) + r, tree, residual)
  result, sent = send(corrected)
  return result, jax.tree.map(jnp.subtract, corrected, sent)


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
  def roundtrip(corrected):
    leaves, treedef = jax.tree.flatten(corrected)
    keys = [None] * len(leaves) if key is None else list(jax.random.split(key, max(len(leaves), 1)))
    decoded = jax.tree.unflatten(
        treedef, [codec.roundtrip(leaf, leaf_key, **kernel_options)
                  for leaf, leaf_key in zip(leaves, keys)])
    return decoded, decoded

  decoded, residual = with_error_feedback(roundtrip, tree, state.residual)
  return decoded, ErrorFeedbackState(residual)
