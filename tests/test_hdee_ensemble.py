"""HDEE ensemble math against hand computations on toy experts."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from lowcomm_jax import testing
from lowcomm_jax.hdee import ensemble


def _log_domain_bound(expected, log_magnitude, num_operations=8):
  """exp of a float32 log-domain result of ≤ `num_operations` roundings of values ≤ `log_magnitude`
  (the inputs' logs, their running sums, a log-sum-exp): an absolute error Δ there is a relative
  error Δ of the probability, plus exp's own rounding."""
  return np.abs(expected) * testing.operation_error_bound(log_magnitude + 1, num_operations)

# Two experts, one sequence of three tokens, with known next-token probabilities.
P1 = [0.5, 0.25, 0.8]
P2 = [0.25, 0.5, 0.1]
LOG_PROBS = np.log(np.array([[P1], [P2]], np.float32))  # [E=2, B=1, T=3]


def test_posterior_weights_equal_hand_computation_uniform_prior():
  weights = np.exp(ensemble.posterior_log_weights(LOG_PROBS))[:, 0, :]
  # t=0: the prior. t=1: proportional to (0.5, 0.25). t=2: to (0.5*0.25, 0.25*0.5).
  expected = np.array([[1 / 2, 2 / 3, 1 / 2],
                       [1 / 2, 1 / 3, 1 / 2]])
  # logs ≤ |log 0.25| + |log 0.5| + log 2 < 3 in magnitude
  testing.assert_within(weights, expected, _log_domain_bound(expected, 3), "weights")
  mixture = np.exp(ensemble.ensemble_log_probs(LOG_PROBS))[0]
  expected = np.array([0.5 * 0.5 + 0.5 * 0.25, 2 / 3 * 0.25 + 1 / 3 * 0.5, 0.5 * 0.8 + 0.5 * 0.1])
  testing.assert_within(mixture, expected, _log_domain_bound(expected, 3), "mixture")


def test_posterior_weights_with_a_prior():
  log_prior = jnp.log(jnp.array([0.8, 0.2]))
  weights = np.exp(ensemble.posterior_log_weights(LOG_PROBS, log_prior))[:, 0, :]
  # t=1: (0.8*0.5, 0.2*0.25) = (0.4, 0.05); t=2: (0.4*0.25, 0.05*0.5) = (0.1, 0.025).
  expected = np.array([[0.8, 0.4 / 0.45, 0.1 / 0.125],
                       [0.2, 0.05 / 0.45, 0.025 / 0.125]])
  # |log 0.2| + 3
  testing.assert_within(weights, expected, _log_domain_bound(expected, 4), "weights")


def test_weights_sum_to_one_everywhere():
  rng = np.random.default_rng(0)
  log_probs = np.log(rng.uniform(1e-4, 1.0, size=(4, 3, 50))).astype(np.float32)
  log_prior = jnp.log(jnp.array([0.1, 0.2, 0.3, 0.4]))
  for prior in (None, log_prior):
    total = np.exp(ensemble.posterior_log_weights(log_probs, prior)).sum(axis=0)
    # each weight's relative error: one log_softmax over E = 4 (|d − L|·e^d ≤ log E + 1), numpy's
    # exp; then numpy's sum of 4 weights of total 1
    bound = (
      testing.logsumexp_error_bound(math.log(4) + 1, 4)
      + testing.operation_error_bound(1.0, 2)
      + testing.sum_error_bound(1.0, 4)
    )
    testing.assert_within(total, np.ones((3, 50)), bound, "Σ weights")


def test_identical_experts_equal_one_expert():
  rng = np.random.default_rng(1)
  one = np.log(rng.uniform(1e-3, 1.0, size=(1, 2, 40))).astype(np.float32)
  three = np.repeat(one, 3, axis=0)
  prior = jnp.log(jnp.array([0.7, 0.2, 0.1]))
  # Σ_e w_e p = p for any normalized w, so only the two passes' own roundings count (log_softmax
  # over E = 3, logsumexp of log w + log p): magnitudes ≤ |log p| + |log 0.1| + log 3 + 1
  mixture_bound = testing.logsumexp_error_bound(np.abs(one[0]) + 2.31 + math.log(3) + 1, 3, 2)
  for log_prior in (None, prior):
    testing.assert_within(ensemble.ensemble_log_probs(three, log_prior), one[0], mixture_bound,
                          f"mixture, prior {log_prior}")
  # (x + x + x) / 3: one inexact add and the division, relative to |x|
  testing.assert_within(ensemble.simple_average_log_probs(three), one[0],
                        testing.operation_error_bound(np.abs(one[0]), 2), "simple average")
  # the experts' totals over T = 40 agree to sum_error_bound; each of the N = 2 folds' log_softmax
  # doubles its input's gap (×2 again at the end); 2N + 1 passes of magnitude ≤ 2|log 0.3| + log 3 +
  # 1
  totals_gap = testing.sum_error_bound(np.abs(one[0]).sum(axis=1), 40).sum()
  prior_bound = (4 * totals_gap + testing.logsumexp_error_bound(2 * 1.21 + math.log(3) + 1, 3, 5)
                 + testing.operation_error_bound(1.0, 2)) / 3
  testing.assert_within(np.exp(ensemble.cached_log_prior(three)), [1 / 3] * 3, prior_bound, "prior")
  scores = ensemble.evaluate_domain(three, three)
  for method in ("uniform_prior", "cached_prior"):  # log-probs within mixture_bound of the expert's
    assert abs(scores[method] - scores["best_expert"]) <= testing.perplexity_error_bound(
        scores["best_expert"], one[0], mixture_bound), method


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def test_cached_prior_equals_hand_computation():
  # Totals per sequence (sum over tokens) for two experts and three sequences.
  seq_log_probs = np.log(np.array([[[0.5, 0.5], [0.9, 0.9], [0.2, 0.2]],
                                   [[0.25, 0.5], [0.3, 0.6], [0.8, 0.8]]], np.float32))
  totals = seq_log_probs.sum(axis=2).T  # [N, E]
  prior = np.zeros(2)  # The reference starts from log pi = 0.
  for k, total in enumerate(totals[:2], start=1):  # Only the first two sequences.
    posterior = _softmax(prior + total)
    prior = np.log(0.3**k * np.exp(prior) + posterior)
  expected = _softmax(prior)
  got = np.exp(ensemble.cached_log_prior(seq_log_probs, num_sequences=2, decay=0.3))
  # logs ≤ 2·|log 0.2| + 1 < 5; ≤ 16 roundings over the two sequences' updates and the softmax
  bound = _log_domain_bound(expected, 5, 16)
  testing.assert_within(got, expected, bound, "prior")
  testing.assert_within(got.sum(), 1.0, bound.sum() + testing.operation_error_bound(1.0, 1),
                        "prior's sum")
  assert got[0] > got[1]  # Expert 0 explains the first two sequences better.


def test_perplexity_best_expert_and_masks():
  # hand values from exact logs: add the inputs' float32 rounding (1 rounding; numpy's float32 log
  # below is within 4 ulps) to the perplexity's own
  quarter = np.full((2, 5), math.log(1 / 4))
  testing.assert_within(float(ensemble.perplexity(jnp.asarray(quarter, jnp.float32))), 4.0,
                        testing.perplexity_error_bound(4.0, quarter, testing.operation_error_bound(
                            np.abs(quarter), 1)), "perplexity")
  log_probs = jnp.array([[math.log(0.5), math.log(0.1)]])
  mask = jnp.array([[1, 0]])
  testing.assert_within(float(ensemble.perplexity(log_probs, mask)), 2.0,
                        testing.perplexity_error_bound(
      2.0, [math.log(0.5)], testing.operation_error_bound(math.log(2), 1)), "masked perplexity")
  assert ensemble.best_expert(LOG_PROBS) == 0  # Geometric means 0.43 vs 0.23.
  scores = ensemble.evaluate_domain(LOG_PROBS, LOG_PROBS)
  assert scores["best_expert_index"] == 0
  best = (0.5 * 0.25 * 0.8) ** (-1 / 3)
  testing.assert_within(scores["best_expert"], best, testing.perplexity_error_bound(
      best, LOG_PROBS[0], testing.operation_error_bound(np.abs(LOG_PROBS[0]), 4)), "best expert")
  average = math.exp(-np.mean(np.log(P1) + np.log(P2)) / 2)
  # the experts' mean first: one add and a halving (exact) per token before the tokens' mean
  testing.assert_within(scores["simple_average"], average, testing.perplexity_error_bound(
      average, LOG_PROBS.mean(axis=0),
      testing.operation_error_bound(np.abs(LOG_PROBS).max(axis=0), 5)),
      "simple average")
  assert scores["cached_prior"] <= scores["uniform_prior"]


def test_bad_input_errors():
  with pytest.raises(ValueError, match=r"\[experts, batch, time\]"):
    ensemble.ensemble_log_probs(np.zeros((2, 3)))
  with pytest.raises(ValueError, match=r"log_prior_E must have shape \(2,\)"):
    ensemble.posterior_log_weights(LOG_PROBS, jnp.zeros(3))
  with pytest.raises(ValueError, match="decay must be in"):
    ensemble.cached_log_prior(LOG_PROBS, decay=1.5)
  with pytest.raises(ValueError, match="validation has 2 experts, test 3"):
    ensemble.evaluate_domain(LOG_PROBS, np.zeros((3, 1, 3)))
