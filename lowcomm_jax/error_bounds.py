"""Float32 error bounds for comparing two evaluations of the same arithmetic.

Two programs that compute one value with sums in another order (XLA fusions, another CPU's vector
width, a sharded sum) differ by at most a bound that follows from the magnitude and the length of
the sums (Higham's γₙ = n·u/(1 − n·u), u = 2⁻²⁴ for float32). Tests compare with these bounds, never
with a tolerance fitted to one machine; `lowcomm_jax.testing` re-exports them.
"""

from __future__ import annotations

import math

import jax
import numpy as np

FLOAT32_ROUNDOFF = 2.0**-24  # u: float32's unit roundoff


def sum_error_bound(abs_sum, length: int, dtype=np.float32):
  """Largest |a − b| between two evaluations of one sum of `length` terms in any order.

  Each evaluation is within γ_n·Σ|term| of the exact sum (γ_n = n·u / (1 − n·u), Higham's bound for
  a recursive sum or dot product of n terms, u the unit roundoff: any order, any blocking, FMA or
  not), so two of them differ by at most 2·γ_n·Σ|term|. `abs_sum` is Σ|term| (an array: one bound
  per element). Independent of the CPU: it holds for every order a vectorized kernel may pick.
  """
  u = float(np.finfo(dtype).eps) / 2
  n = max(int(length), 1)
  if n * u >= 1:
    raise ValueError(f"a sum of {n} terms has no useful {np.dtype(dtype).name} error bound")
  return 2 * (n * u / (1 - n * u)) * np.asarray(abs_sum, np.float64)


def einsum_error_bound(spec: str, *operands):
  """`sum_error_bound` of each element of `jnp.einsum(spec, *operands)`: Σ|a|·|b| over its
  contracted indices (computed in float64), their count the sum's length."""
  inputs, output = spec.replace(" ", "").split("->")
  sizes = {}
  for letters, x in zip(inputs.split(","), operands):
    sizes.update(zip(letters, np.shape(x)))
  length = math.prod(sizes[c] for c in sizes if c not in output)
  magnitude = np.einsum(spec, *(np.abs(np.asarray(x, np.float64)) for x in operands))
  return sum_error_bound(magnitude, length)


def assert_within(actual, expected, bound, what: str = "") -> None:
  """|actual − expected| ≤ bound elementwise (bound from `sum_error_bound`/`einsum_error_bound`)."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  excess = np.abs(actual - expected) - np.broadcast_to(bound, actual.shape)
  worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else ()
  assert actual.shape == expected.shape and (excess.size == 0 or excess[worst] <= 0), (
      f"{what}: |difference| over the float32 bound by {excess[worst]:.3g} at {worst}"
      if excess.size else f"{what}: shapes {actual.shape} and {expected.shape}")


def operation_error_bound(magnitude, num_operations: int, dtype=np.float32):
  """Largest |a − b| between two evaluations of one formula of `num_operations` rounded operations
  (elementwise, no sums: those take `sum_error_bound`) whose intermediate values are at most
  `magnitude`: each rounding moves each side by at most u·magnitude (to first order, for a formula
  that does not amplify its inputs' errors), so 2·n·u·magnitude. Independent of the CPU."""
  u = float(np.finfo(dtype).eps) / 2
  return 2 * int(num_operations) * u * np.asarray(magnitude, np.float64)


def logsumexp_error_bound(magnitude, num_terms: int, num_passes: int = 1):
  """Largest |a − b| between two float32 evaluations of `num_passes` chained log_softmax or
  logsumexp over `num_terms` terms, from their own roundings (not their inputs' errors): per pass
  the max's subtraction, exp, log and the final add round once each relative to `magnitude` (the
  largest |input − max| or output; a term's e^d·|d| ≤ 1/e where exp damps it), and the sum of the
  exps, in [1, n], has relative error γ_n, which log turns into that absolute error. Independent of
  the CPU."""
  return int(num_passes) * (operation_error_bound(magnitude, 4) + sum_error_bound(1.0, num_terms))


def perplexity_error_bound(perplexity, log_probs, log_prob_error=0.0):
  """Largest |a − b| between two float32 evaluations of exp(−mean log p) over the n real tokens
  `log_probs`: the mean's sum (`sum_error_bound` of Σ|log p|, over n), its division and exp
  (`operation_error_bound`), plus `log_prob_error` (elementwise, averaged) already in the
  log-probs; a change Δ of the mean is a relative change Δ of the perplexity (Δ ≪ 1)."""
  a = np.abs(np.asarray(log_probs, np.float64))
  n = max(a.size, 1)
  mean_error = (sum_error_bound(a.sum(), n) / n + operation_error_bound(a.max() + 1, 2)
                + float(np.mean(log_prob_error)))
  return float(perplexity) * mean_error


def attention_error_bound(q, k, seq_len: int, reference):
  """float32 rounding of attention's sums between two implementations, from their lengths and
  magnitudes: a score sums K products (relative error ≲ K·ε·|q|·|k|/√K, which exp turns into a
  relative error of the probabilities), a weighted sum adds S terms (≲ S·ε·max|v|); bounded by the
  largest entry of what is compared. Factor 4 for the two implementations' independent roundings,
  both ways. q, k: [..., K] (K the head dimension); seq_len: S, the keys per query."""
  eps = float(np.finfo(np.float32).eps)
  k_dim, s = np.shape(q)[-1], int(seq_len)
  score_error = k_dim * eps * float(np.max(np.abs(q)) * np.max(np.abs(k))) / k_dim ** 0.5
  return 4 * (score_error + s * eps) * float(np.max(np.abs(reference)))


def trajectory_error_bound(reference, num_steps: int, terms_per_step: int):
  """Bound between two float32 training trajectories that sum in other orders (vmap vs a mesh, one
  batch vs its shards, a fused vs an unfused update): each step adds at most the rounding of sums
  of `terms_per_step` terms at the scale of `reference` (its largest entry), and those errors add up
  over `num_steps` (to first order; a contracting optimizer does not amplify them). Relative to the
  compared values' scale and to u·n, so independent of the CPU; a wrong algorithm differs by the
  size of an update, orders above it."""
  scale = max((float(np.max(np.abs(np.asarray(x, np.float64)))) for x in jax.tree.leaves(reference)
               if np.size(x)), default=0.0)
  return sum_error_bound(scale, int(num_steps) * int(terms_per_step))


def assert_trees_within(actual, expected, bound, what: str = "") -> None:
  """`assert_within` on every leaf of two trees; `bound` a number or a function of the expected
  leaf."""
  leaves = jax.tree_util.tree_leaves_with_path(expected)
  assert len(leaves) == len(jax.tree.leaves(actual)), f"{what}: trees differ"
  for (path, b), a in zip(leaves, jax.tree.leaves(actual), strict=True):
    assert_within(np.asarray(a), np.asarray(b), bound(b) if callable(bound) else bound,
                  f"{what}{jax.tree_util.keystr(path)}")


def chain_of_sums(model_cfg, seq_len: int, tokens: int = 0) -> int:
  """The longest chain of float32 sums behind the decoder's loss (`tokens` > 0) or logits (0): per
  block q, k, v and o over d, scores over the head dimension, weights over T = `seq_len`, the MLP
  over d then d_ff; the head over d, then for a loss the softmax over V and the mean over `tokens`.
  The `length` of `sum_error_bound` for one evaluation, the `terms_per_step` of
  `trajectory_error_bound`."""
  c = model_cfg
  per_block = 4 * c.d_model + c.head_dim + seq_len + c.d_model + c.d_ff
  return c.num_layers * per_block + c.d_model + ((c.vocab_size + tokens) if tokens else 0)


def tiny_chain_of_sums(seq_len: int, tokens: int) -> int:
  """`chain_of_sums` of the `tiny` model's loss."""
  from lowcomm_jax import models  # pylint: disable=g-import-not-at-top
  return chain_of_sums(models.get_model_config("tiny"), seq_len, tokens)
