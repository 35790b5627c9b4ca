"""Reference entropies of a token stream, in nats per token, to judge a language model's loss."""

from __future__ import annotations

import numpy as np


def unigram_entropy(tokens: np.ndarray, vocab_size: int = 256) -> float:
  """H(X) of the empirical token distribution of `tokens` itself."""
  counts = np.bincount(tokens.astype(np.int64), minlength=vocab_size).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def bigram_cross_entropy(train_tokens: np.ndarray, eval_tokens: np.ndarray,
                         vocab_size: int = 256, smoothing: float = 0.01) -> float:
  """Mean −log p(x_t | x_{t−1}) on `eval_tokens` under a bigram model counted on `train_tokens`.

  The estimate of the bigram conditional entropy of the eval text from the
  training text; add-`smoothing` counts keep unseen pairs finite.
  """
  train = train_tokens.astype(np.int64)
  counts = np.full((vocab_size, vocab_size), smoothing)
  np.add.at(counts, (train[:-1], train[1:]), 1.0)
  log_p = np.log(counts / counts.sum(axis=1, keepdims=True))
  ev = eval_tokens.astype(np.int64)
  return float(-log_p[ev[:-1], ev[1:]].mean())
