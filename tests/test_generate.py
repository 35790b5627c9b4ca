"""Sampling with the key/value cache (`models.decode`) against the full forward, and the binary."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowcomm_jax.models import config as model_config, decode, llama
from lowcomm_jax.testing import ROOT

CFG = dataclasses.replace(model_config.PRESETS["tiny"], max_seq_len=32)
PROMPT = np.array([[72, 101, 108, 108, 111], [10, 100, 101, 102, 32]], np.int32)
NEW = 12


@pytest.fixture(scope="module")
def params():
  # A larger embedding/head than init gives makes the logits far from ties, so that float32
  # rounding between the two paths cannot flip an argmax.
  p = llama.init_params(CFG, 3)
  return {**p, "head": p["head"] * 50.0}


def _greedy_full_forward(params, prompt, new):
  """Greedy decoding without a cache: the whole sequence's forward for every new token, on a
  fixed-length buffer (causal: positions after the last written one do not change its logits)."""
  model = nnx.merge(decode.graphdef_of(CFG), params)
  forward = jax.jit(lambda tokens: model(tokens))
  b, p = prompt.shape
  tokens = np.zeros((b, p + new), np.int32)
  tokens[:, :p] = prompt
  logits_steps = []
  for i in range(new):
    logits = np.asarray(forward(jnp.asarray(tokens)))[:, p + i - 1]
    logits_steps.append(logits)
    tokens[:, p + i] = logits.argmax(-1)
  return tokens, np.stack(logits_steps, 1)


def test_greedy_with_the_cache_equals_greedy_with_the_full_forward(params):
  expected, full_logits = _greedy_full_forward(params, PROMPT, NEW)
  got = decode.generate(CFG, params, PROMPT, NEW, decode.GREEDY)
  np.testing.assert_array_equal(got, expected)
  # The cached forward's logits at each step, against the full forward's: the same products, the
  # attention sums taken over the cache's zero-padded slots (exact zeros after the mask). The
  # logits are O(|head|·√D); float32 rounding of sums over D = 32 and d_ff = 64 terms through 2
  # layers stays within a few hundred ulps of that magnitude.
  model = nnx.merge(decode.graphdef_of(CFG), params)
  cache = decode.empty_cache(CFG, 2, PROMPT.shape[1] + NEW)
  logits, cache = decode.forward_cached(model, jnp.asarray(got[:, :PROMPT.shape[1]]), cache, 0)
  cached = [np.asarray(logits[:, -1])]
  for pos in range(PROMPT.shape[1], PROMPT.shape[1] + NEW - 1):
    logits, cache = decode.forward_cached(model, jnp.asarray(got[:, pos:pos + 1]), cache, pos)
    cached.append(np.asarray(logits[:, 0]))
  scale = np.abs(full_logits).max()
  np.testing.assert_allclose(np.stack(cached, 1), full_logits, rtol=0, atol=512 * 2**-23 * scale)


def test_top_k_one_is_greedy_and_a_seed_reproduces(params):
  greedy = decode.generate(CFG, params, PROMPT, NEW, decode.GREEDY)
  top1 = decode.generate(CFG, params, PROMPT, NEW, decode.Sampling(temperature=1.0, top_k=1), seed=5)
  np.testing.assert_array_equal(top1, greedy)
  hot = decode.Sampling(temperature=2.0, top_k=50, top_p=0.95)
  a = decode.generate(CFG, params, PROMPT, NEW, hot, seed=1)
  np.testing.assert_array_equal(decode.generate(CFG, params, PROMPT, NEW, hot, seed=1), a)
  assert (decode.generate(CFG, params, PROMPT, NEW, hot, seed=2) != a).any()
  np.testing.assert_array_equal(a[:, :PROMPT.shape[1]], PROMPT)


def test_sample_filters():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 2000)
  draw = lambda s: np.asarray(jax.vmap(lambda k: decode.sample(logits, s, k))(keys))[:, 0]
  # top_p = 0.7: 0.5 alone is below 0.7, 0.5 + 0.3 reaches it, so tokens 0 and 1 are kept.
  assert set(draw(decode.Sampling(top_p=0.7))) == {0, 1}
  assert set(draw(decode.Sampling(top_k=3))) == {0, 1, 2}
  # Unfiltered at T = 1, token 3 (p = 0.05) is drawn ~100 times in 2000 draws (σ ≈ 10).
  assert 50 < (draw(decode.Sampling()) == 3).sum() < 150
  assert set(draw(decode.Sampling(top_p=0.1))) == {0}  # the most likely token is always kept


@pytest.mark.parametrize("prompt_len,new,message", [
    (0, 4, "--prompt must hold at least one token"),
    (30, 4, "exceeds the model's context of 32 tokens (model.max_seq_len)"),
    (3, 0, "--max_new_tokens must be an integer >= 1"),
])
def test_lengths_are_refused_naming_the_flag(prompt_len, new, message):
  with pytest.raises(ValueError, match=None) as error:
    decode.check_length(CFG, prompt_len, new)
  assert message in str(error.value)
