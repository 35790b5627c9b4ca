"""Autoregressive sampling from the Llama-style decoder with a key/value cache, in one jitted
program.

The decoder's own modules (`llama.Decoder`: embedding, RMSNorms, SwiGLU, head, rotary tables) run
unchanged; only attention is written here, because with a cache a query at position p attends to
the keys and values of positions 0..p kept from earlier calls instead of recomputing them. The
prompt is run once (prefill, every prompt position at once), then one token per step: the logits
of the last position are turned into a token by `sample`, the token is fed back.

  tokens = decode.generate(model_cfg, params, prompt_ids, max_new_tokens=64,
                           sampling=decode.Sampling(temperature=0.8, top_k=40), seed=0)

Sampling (`Sampling`): temperature T divides the logits (T = 0: greedy, the argmax); top_k keeps
the k most likely tokens; top_p keeps the smallest set of most likely tokens whose probability
sums to at least p (nucleus sampling, Holtzman et al. 2020, arXiv:1904.09751); the token is then
drawn from the renormalised distribution with `jax.random.categorical`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowcomm_jax.models import llama
from lowcomm_jax.models.config import ModelConfig


class Sampling(NamedTuple):
  """How a token is drawn from the logits (static: one compiled program per setting).

  Attributes:
    temperature: T >= 0; the logits are divided by T; 0 is greedy (argmax).
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: keep the smallest most-likely set with probability >= p, in (0, 1]; 1 keeps all.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0


GREEDY = Sampling(temperature=0.0)


def check_sampling(s: Sampling) -> None:
  """One ValueError naming the option (the generate binary's flags) and its allowed values."""
  if not (np.isfinite(s.temperature) and s.temperature >= 0):
    raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got {s.temperature}")
  if s.top_k < 0:
    raise ValueError(f"--top_k must be an integer >= 0 (0: no top-k filter), got {s.top_k}")
  if not 0 < s.top_p <= 1:
    raise ValueError(f"--top_p must be in (0, 1] (1: no nucleus filter), got {s.top_p}")


def sample(logits_BxV, sampling: Sampling, key) -> jax.Array:
  """Token ids [B] drawn from float32 logits [B, V] as `sampling` says."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits = logits_BxV.astype(jnp.float32) / sampling.temperature
  if 0 < sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p < 1:
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # A token is kept when the probability of the tokens ranked above it is still below p, so the
    # most likely token is always kept; the cut-off is the smallest logit kept.
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(before < sampling.top_p, sorted_desc, jnp.inf), axis=-1,
                     keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Cache(NamedTuple):
  """Keys and values of every layer at every position written so far: [L, B, S, H, K] each."""

  k: jax.Array
  v: jax.Array


def empty_cache(cfg: ModelConfig, batch: int, length: int) -> Cache:
  shape = (cfg.num_layers, batch, length, cfg.num_heads, cfg.head_dim)
  zeros = jnp.zeros(shape, jnp.dtype(cfg.dtype))
  return Cache(zeros, zeros)


def _cached_attention(attn: llama.Attention, x_BxTxD, cos, sin, k_BxSxHxK, v_BxSxHxK, start):
  """The layer's attention for positions start..start+T−1, their keys and values written into the
  cache first; a query at position p sees cache slots 0..p (the causal mask of the full forward)."""
  dt = attn.dtype
  project = lambda w: jnp.einsum("btd,dhk->bthk", x_BxTxD, w[...].astype(dt))
  q = llama.apply_rotary(project(attn.wq), cos, sin)
  k_new = llama.apply_rotary(project(attn.wk), cos, sin)
  k_BxSxHxK = jax.lax.dynamic_update_slice_in_dim(k_BxSxHxK, k_new.astype(k_BxSxHxK.dtype), start,
                                                  1)
  v_BxSxHxK = jax.lax.dynamic_update_slice_in_dim(v_BxSxHxK,
                                                  project(attn.wv).astype(v_BxSxHxK.dtype),
                                                 start, 1)
  scores = jnp.einsum("bthk,bshk->bhts", q, k_BxSxHxK).astype(jnp.float32) / q.shape[-1] ** 0.5
  t, s = scores.shape[-2:]
  visible_TxS = jnp.arange(s)[None, :] <= start + jnp.arange(t)[:, None]
  probs = jax.nn.softmax(jnp.where(visible_TxS, scores, -1e30), axis=-1).astype(dt)
  out = jnp.einsum("bhts,bshk->bthk", probs, v_BxSxHxK)
  return jnp.einsum("bthk,hkd->btd", out, attn.wo[...].astype(dt)), k_BxSxHxK, v_BxSxHxK


def forward_cached(model: llama.Decoder, tokens_BxT, cache: Cache, start):
  """Logits [B, T, V] of tokens at positions start..start+T−1 given the cache of positions before
  them, and the cache with these positions added. Same arithmetic as `Decoder.__call__` (up to the
  order of float32 sums), restricted to the positions asked for."""
  cfg = model.cfg
  dt = jnp.dtype(cfg.dtype)
  t = tokens_BxT.shape[1]
  cos_SxK, sin_SxK = llama.rotary_tables(cache.k.shape[2], cfg.head_dim, cfg.rope_base)
  cos = jax.lax.dynamic_slice_in_dim(cos_SxK, start, t)[None, :, None]
  sin = jax.lax.dynamic_slice_in_dim(sin_SxK, start, t)[None, :, None]
  x_BxTxD = jnp.take(model.embed[...], tokens_BxT, axis=0).astype(dt)
  block_def, blocks_state = nnx.split(model.blocks)

  def run_layer(x, layer):
    layer_state, k_cache, v_cache = layer
    block = nnx.merge(block_def, layer_state)
    h, k_cache, v_cache = _cached_attention(block.attn, block.attn_norm(x), cos, sin, k_cache,
                                            v_cache, start)
    x = x + h
    return x + block.mlp(block.mlp_norm(x)), (k_cache, v_cache)

  x_BxTxD, (k, v) = jax.lax.scan(run_layer, x_BxTxD, (blocks_state, cache.k, cache.v))
  return llama.head_logits(model.final_norm(x_BxTxD), model.head[...], dt), Cache(k, v)


def graphdef_of(cfg: ModelConfig):
  """The Decoder's graph definition, to merge with a pure-dict parameter tree."""
  return nnx.split(nnx.eval_shape(lambda: llama.Decoder(cfg, nnx.Rngs(0))), nnx.Param)[0]


def check_length(cfg: ModelConfig, prompt_len: int, max_new_tokens: int) -> None:
  """Refuses an empty prompt or one that, with the new tokens, exceeds the model's context."""
  if prompt_len < 1:
    raise ValueError("--prompt must hold at least one token, got an empty prompt")
  if max_new_tokens < 1:
    raise ValueError(f"--max_new_tokens must be an integer >= 1, got {max_new_tokens}")
  if prompt_len + max_new_tokens > cfg.max_seq_len:
    raise ValueError(
        f"--prompt ({prompt_len} tokens) plus --max_new_tokens ({max_new_tokens}) exceeds the "
        f"model's context of {cfg.max_seq_len} tokens (model.max_seq_len); shorten the prompt or "
        "ask for fewer tokens")


def generate(cfg: ModelConfig, params, prompt_BxP, max_new_tokens: int,
             sampling: Sampling = GREEDY, seed: int = 0) -> np.ndarray:
  """The prompts [B, P] (int ids) followed by `max_new_tokens` sampled tokens: [B, P + N].

  One compiled program per (shapes, sampling): the prompt's forward fills the cache, then a
  `lax.fori_loop` runs one cached forward and one `sample` per new token. `seed` seeds the draws
  (token i uses `fold_in(key(seed), i)`), so a seed reproduces its samples.
  """
  prompt_BxP = np.asarray(prompt_BxP, np.int32)
  if prompt_BxP.ndim == 1:
    prompt_BxP = prompt_BxP[None]
  check_length(cfg, prompt_BxP.shape[1], max_new_tokens)
  check_sampling(sampling)
  return np.asarray(_generate_fn(cfg, max_new_tokens, sampling)(params, jnp.asarray(prompt_BxP),
                                                                jax.random.key(seed)))


_PROGRAMS: dict = {}


def _generate_fn(cfg: ModelConfig, max_new_tokens: int, sampling: Sampling):
  key = (cfg, max_new_tokens, sampling)
  if key in _PROGRAMS:
    return _PROGRAMS[key]
  graphdef = graphdef_of(cfg)

  def run(params, prompt_BxP, rng):
    model = nnx.merge(graphdef, params)
    b, p = prompt_BxP.shape
    total = p + max_new_tokens
    logits, cache = forward_cached(model, prompt_BxP, empty_cache(cfg, b, total), 0)
    tokens = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompt_BxP)
    tokens = tokens.at[:, p].set(sample(logits[:, -1], sampling, jax.random.fold_in(rng, 0)))

    def step(i, carry):
      tokens, cache = carry
      position = p + i - 1  # the token written last, fed back
      last = jax.lax.dynamic_slice_in_dim(tokens, position, 1, axis=1)
      logits, cache = forward_cached(model, last, cache, position)
      new = sample(logits[:, 0], sampling, jax.random.fold_in(rng, i))
      return jax.lax.dynamic_update_slice_in_dim(tokens, new[:, None], position + 1, 1), cache

    return jax.lax.fori_loop(1, max_new_tokens, step, (tokens, cache))[0]

  _PROGRAMS[key] = jax.jit(run)
  return _PROGRAMS[key]
