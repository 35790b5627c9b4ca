"""HDEE ensemble inference on per-token log-probabilities of the experts.

Every function takes ``log_probs_ExBxT``: ``log p_e(x_t | x_<t)`` of the token
that actually comes next, for each expert ``e``, sequence ``b`` and position
``t``, as a model's log-softmax gathered at the labels gives it. The models
never appear here, so the same math serves trained experts, toy experts in the
tests and byte-bigram experts in the colab.

The mixture (docs/algorithms.md §4.2, the Branch-Train-Merge "ELM forest" posterior)::

  p(x_t | x_<t) = sum_e w_e(t) p_e(x_t | x_<t)
  w_e(t)        = softmax_e( log pi_e + sum_{s<t} log p_e(x_s | x_<s) )

``w(t)`` is the posterior over experts given the sequence's prefix, which
restarts at every sequence. The prior ``pi`` is uniform, or the cached prior of
a domain: built from its first validation sequences, folding in each sequence's
posterior with a decay (`cached_log_prior`). Baselines: the simple average of
the experts' log-softmax (`simple_average_log_probs`, the reference code's
``simple_avg``) and the single best expert chosen on validation text
(`best_expert`). The parameter-averaged model needs the models, so it is not here.

References:
  Ersoy, Kolehmainen, Andrade, "HDEE: Heterogeneous Domain Expert Ensemble",
  arXiv:2502.19385. Li et al., "Branch-Train-Merge", arXiv:2208.03306.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

# The reference code folds in 100 validation sequences with decay 0.3.
CACHED_PRIOR_SEQUENCES = 100
CACHED_PRIOR_DECAY = 0.3


def _check_log_probs(log_probs_ExBxT: jax.Array, name: str = "log_probs_ExBxT") -> jax.Array:
  log_probs_ExBxT = jnp.asarray(log_probs_ExBxT)
  if log_probs_ExBxT.ndim != 3 or 0 in log_probs_ExBxT.shape:
    raise ValueError(f"{name} must be a non-empty [experts, batch, time] array, "
                     f"got shape {log_probs_ExBxT.shape}")
  return log_probs_ExBxT


def _check_log_prior(log_prior_E: jax.Array, num_experts: int) -> jax.Array:
  log_prior_E = jnp.asarray(log_prior_E, jnp.float32)
  if log_prior_E.shape != (num_experts,):
    raise ValueError(f"log_prior_E must have shape ({num_experts},) for {num_experts} "
                     f"experts, got {log_prior_E.shape}")
  return log_prior_E


def uniform_log_prior(num_experts: int) -> jax.Array:
  """``log(1/E)`` for every expert."""
  if num_experts < 1:
    raise ValueError(f"num_experts must be >= 1, got {num_experts}")
  return jnp.full((num_experts,), -jnp.log(num_experts), jnp.float32)


def posterior_log_weights(log_probs_ExBxT: jax.Array,
                          log_prior_E: jax.Array | None = None) -> jax.Array:
  """``log w_e(t)``: the posterior over experts given each position's prefix.

  Args:
    log_probs_ExBxT: per-token log-probabilities of each expert.
    log_prior_E: log prior over experts; None means uniform.

  Returns:
    [E, B, T] log weights; ``exp`` sums to 1 over experts at every (b, t).
    At t = 0 the weights are the prior.
  """
  log_probs_ExBxT = _check_log_probs(log_probs_ExBxT)
  num_experts = log_probs_ExBxT.shape[0]
  log_prior_E = (uniform_log_prior(num_experts) if log_prior_E is None
                 else _check_log_prior(log_prior_E, num_experts))
  # Exclusive prefix sum: position t sees the evidence of positions s < t only.
  prefix_ExBxT = jnp.cumsum(log_probs_ExBxT, axis=2) - log_probs_ExBxT
  return jax.nn.log_softmax(log_prior_E[:, None, None] + prefix_ExBxT, axis=0)


def ensemble_log_probs(log_probs_ExBxT: jax.Array,
                       log_prior_E: jax.Array | None = None) -> jax.Array:
  """``log p(x_t | x_<t)`` of the posterior-weighted mixture, [B, T]."""
  log_weights_ExBxT = posterior_log_weights(log_probs_ExBxT, log_prior_E)
  return jax.nn.logsumexp(log_weights_ExBxT + jnp.asarray(log_probs_ExBxT), axis=0)


def simple_average_log_probs(log_probs_ExBxT: jax.Array) -> jax.Array:
  """Mean over experts of the log-probabilities, [B, T] (reference ``simple_avg``).

  This is the log of the experts' geometric mean, not renormalized over the
  vocabulary, exactly as the reference code scores it.
  """
  return jnp.mean(_check_log_probs(log_probs_ExBxT), axis=0)


def cached_log_prior(log_probs_ExNxT: jax.Array,
                     num_sequences: int = CACHED_PRIOR_SEQUENCES,
                     decay: float = CACHED_PRIOR_DECAY,
                     mask_NxT: jax.Array | None = None) -> jax.Array:
  """A domain's prior over experts from its first validation sequences.

  Starting from ``log pi = 0``, sequence k = 1, 2, ... (in order) is folded in as::

    log posterior_k = log_softmax_e( log pi_e + sum_t log p_e(x_t) )
    log pi         <- log( decay^k * exp(log pi) + exp(log posterior_k) )

  and the result is ``log_softmax(log pi)``. ``decay^k`` uses the 1-based
  count k, as the reference implementation does.

  Args:
    log_probs_ExNxT: per-token log-probabilities of the validation sequences,
      in the order they are read.
    num_sequences: how many of the first sequences to use.
    decay: the decay base.
    mask_NxT: optional 1/0 mask of real tokens (padding excluded from sums).

  Returns:
    [E] normalized log prior.
  """
  log_probs_ExNxT = _check_log_probs(log_probs_ExNxT, "log_probs_ExNxT")
  if num_sequences < 1:
    raise ValueError(f"num_sequences must be >= 1, got {num_sequences}")
  if not 0.0 <= decay <= 1.0:
    raise ValueError(f"decay must be in [0, 1], got {decay}")
  if mask_NxT is not None:
    log_probs_ExNxT = log_probs_ExNxT * jnp.asarray(mask_NxT, log_probs_ExNxT.dtype)[None]
  totals_NxE = jnp.sum(log_probs_ExNxT[:, :num_sequences], axis=2).T
  count = totals_NxE.shape[0]
  log_decays_N = jnp.arange(1, count + 1, dtype=jnp.float32) * jnp.log(jnp.float32(decay))

  def fold(log_prior_E, inputs):
    total_E, log_decay = inputs
    log_posterior_E = jax.nn.log_softmax(log_prior_E + total_E)
    return jnp.logaddexp(log_decay + log_prior_E, log_posterior_E), None

  log_prior_E, _ = jax.lax.scan(fold, jnp.zeros(totals_NxE.shape[1], jnp.float32),
                                (totals_NxE.astype(jnp.float32), log_decays_N))
  return jax.nn.log_softmax(log_prior_E)


def mean_log_prob(log_probs_BxT: jax.Array, mask_BxT: jax.Array | None = None) -> jax.Array:
  """Mean per-token log-probability, over real tokens when a mask is given."""
  log_probs_BxT = jnp.asarray(log_probs_BxT)
  if mask_BxT is None:
    return jnp.mean(log_probs_BxT)
  mask_BxT = jnp.asarray(mask_BxT, log_probs_BxT.dtype)
  return jnp.sum(log_probs_BxT * mask_BxT) / jnp.sum(mask_BxT)


def perplexity(log_probs_BxT: jax.Array, mask_BxT: jax.Array | None = None) -> jax.Array:
  """``exp(-mean log p)``: token perplexity."""
  return jnp.exp(-mean_log_prob(log_probs_BxT, mask_BxT))


def best_expert(log_probs_ExBxT: jax.Array, mask_BxT: jax.Array | None = None) -> int:
  """Index of the expert with the highest mean log-probability (pick it on validation text)."""
  log_probs_ExBxT = _check_log_probs(log_probs_ExBxT)
  scores_E = jnp.stack([mean_log_prob(lp, mask_BxT) for lp in log_probs_ExBxT])
  return int(jnp.argmax(scores_E))


def evaluate_domain(validation_log_probs_ExNxT: jax.Array, test_log_probs_ExBxT: jax.Array,
                    validation_mask_NxT: jax.Array | None = None,
                    test_mask_BxT: jax.Array | None = None) -> Mapping[str, float]:
  """Test perplexity of every ensemble method on one domain.

  The cached prior and the best expert are chosen on the validation
  sequences; everything is scored on the test sequences.

  Returns:
    ``{"uniform_prior", "cached_prior", "simple_average", "best_expert"}``
    perplexities, ``"best_expert_index"``, and ``"cached_prior_weights"``
    (a list, one weight per expert).
  """
  test = _check_log_probs(test_log_probs_ExBxT, "test_log_probs_ExBxT")
  validation = _check_log_probs(validation_log_probs_ExNxT, "validation_log_probs_ExNxT")
  if validation.shape[0] != test.shape[0]:
    raise ValueError(f"validation has {validation.shape[0]} experts, test {test.shape[0]}")
  log_prior_E = cached_log_prior(validation, mask_NxT=validation_mask_NxT)
  index = best_expert(validation, validation_mask_NxT)
  return {
      "uniform_prior": float(perplexity(ensemble_log_probs(test), test_mask_BxT)),
      "cached_prior": float(perplexity(ensemble_log_probs(test, log_prior_E), test_mask_BxT)),
      "simple_average": float(perplexity(simple_average_log_probs(test), test_mask_BxT)),
      "best_expert": float(perplexity(test[index], test_mask_BxT)),
      "best_expert_index": index,
      "cached_prior_weights": [float(w) for w in jnp.exp(log_prior_E)],
  }


METHODS = ("uniform_prior", "cached_prior", "simple_average", "best_expert")


def format_scores_table(scores: Mapping[str, Mapping[str, float]],
                        expert_names: list[str] | None = None) -> str:
  """Markdown: one row per domain of `evaluate_domain` perplexities, best method in bold."""
  lines = ["| domain | " + " | ".join(METHODS) + " | best single expert |",
           "|---" * (len(METHODS) + 2) + "|"]
  for domain, result in scores.items():
    best = min(METHODS, key=lambda m: result[m])
    cells = [f"**{result[m]:.3f}**" if m == best else f"{result[m]:.3f}" for m in METHODS]
    index = result["best_expert_index"]
    expert = expert_names[index] if expert_names else str(index)
    lines.append(f"| {domain} | " + " | ".join(cells) + f" | {expert} |")
  return "\n".join(lines)
