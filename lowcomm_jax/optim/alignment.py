"""HeLoCo: each outer gradient aligned with the outer momentum, block by block, before the outer
optimizer steps on it (Al Asif et al., arXiv 2606.00271; docs/algorithms.md §1.8).

A stale Δ (computed from an older φ) may point against where φ is now going. HeLoCo takes the
outer momentum m as that direction and, per tensor block b (here: each parameter leaf), with
u = Δ_b/‖Δ_b‖, v = m_b/‖m_b‖ and the cosine c = u·v:

  conf = ‖Δ_b‖ / (‖Δ_b‖ + κ·‖m_b‖ + ε)                 how much Δ_b weighs against m_b
  c ≥ c_ok:      Δ̂_b = Δ_b                              aligned: kept
  c < 0:         Δ̂_b = Δ_b − β·c·‖Δ_b‖·v,  β = min(k_s·(−c)·conf, β_max)
                                                       anti-aligned: its part along −m shrunk by β
  0 ≤ c < c_ok:  Δ̂_b = ‖Δ_b‖·ũ / max(‖ũ‖, ε),  ũ = (1 − λ)·u + λ·v,  λ = min(k_d·(1 − c)·conf, 1)
                                                       weak: turned part way toward m, norm kept

`heloco(outer)` is `outer` with every update so corrected against the momentum buffer of `outer`'s
own state (Nesterov's trace, Delayed Nesterov's b) before `outer` updates; its state is `outer`'s,
unchanged, so a checkpoint, a replay and a learner's state do not see it. The paper then weighs
the corrected Δ̂ by the delay weight ρ and steps the outer optimizer on it.

Where the paper leaves a choice open, or where we depart from it (ours):
  - m = 0 (no momentum yet: the first merge, or the first N with Delayed Nesterov) or Δ_b = 0:
    Δ_b passes unchanged (v, u undefined).
  - c_ok < 0: the first case wins, so a block with c_ok ≤ c < 0 is kept.
  - m is the outer optimizer's own buffer b (b ← μ·b + Δ, so ‖b‖ is up to ‖Δ‖/(1 − μ)); the paper
    writes its momentum as an average, m ← μ·m + (1 − μ)·Δ̂, which is (1 − μ)·b. The direction v
    is the same; in conf, κ weighs ‖b‖ itself (κ = 0.1 with μ = 0.9 weighs it as κ = 1 would the
    average).
  - The elastic syncer weighs each Δ before the outer optimizer (ρ = 1/(1 + r) times its tokens'
    share, w in all), so this aligns w·Δ. That is w·Δ̂ of the paper's order (align, then weigh)
    except in conf, which sees w·‖Δ_b‖: equal for learners in step with equal H (w = 1), a staler
    Δ is corrected a little less.
  - The defaults (c_ok 0.2, k_s 1, β_max 0.5, k_d 0.5, κ 0.1, ε 1e-8).
  - c is clipped to [−1, 1] (float32 rounding may leave it just outside).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from lowcomm_jax import checks
from lowcomm_jax.optim.outer import DelayedNesterovState, check_transformation

DEFAULTS = dict(keep=0.2, shrink=1.0, max_shrink=0.5, reorient=0.5, momentum_weight=0.1)
EPS = 1e-8


# each hyperparameter's range, (low, high, high_open) as `checks.number` takes it
RANGES = {"keep": (-1, 1, False), "shrink": (0, math.inf, True), "max_shrink": (0, 1, False),
          "reorient": (0, math.inf, True), "momentum_weight": (0, math.inf, True)}


def check_hyperparameters(values, prefix: str = "") -> None:
  """One ValueError naming the first of `values`' hyperparameters (at dotted keys `prefix` + name:
  a dict of them, or a config with prefix "elastic.heloco_") outside its range."""
  for name, (low, high, high_open) in RANGES.items():
    checks.number(values, prefix + name, low, high, high_open=high_open)


def align_block(delta, momentum, keep=DEFAULTS["keep"], shrink=DEFAULTS["shrink"],
                max_shrink=DEFAULTS["max_shrink"], reorient=DEFAULTS["reorient"],
                momentum_weight=DEFAULTS["momentum_weight"], eps=EPS):
  """Δ̂_b of one block `delta` against the momentum `momentum` of the same shape (module doc),
  computed in float32, returned in `delta`'s dtype. keep = c_ok, shrink = k_s, max_shrink = β_max,
  reorient = k_d, momentum_weight = κ."""
  delta = jnp.asarray(delta)
  d = delta.astype(jnp.float32)
  m = jnp.asarray(momentum, jnp.float32)
  norm_d, norm_m = jnp.sqrt(jnp.sum(d * d)), jnp.sqrt(jnp.sum(m * m))
  defined = (norm_d > 0) & (norm_m > 0)
  u = d / jnp.where(defined, norm_d, 1.0)
  v = m / jnp.where(defined, norm_m, 1.0)
  c = jnp.clip(jnp.sum(u * v), -1.0, 1.0)

  def corrected(delta):
    conf = norm_d / (norm_d + momentum_weight * norm_m + eps)
    beta = jnp.minimum(shrink * (-c) * conf, max_shrink)
    shrunk = d - beta * c * norm_d * v
    lam = jnp.minimum(reorient * (1.0 - c) * conf, 1.0)
    turned = (1.0 - lam) * u + lam * v
    reoriented = norm_d * turned / jnp.maximum(jnp.sqrt(jnp.sum(turned * turned)), eps)
    return jnp.where(c < 0, shrunk, reoriented).astype(delta.dtype)

  # A kept block is Δ_b itself, and a branch of its own: what follows (the outer optimizer's
  # arithmetic) then compiles as it does without the alignment, bit for bit (fused with the
  # correction, XLA may contract its multiply-adds otherwise, a rounding apart). Under vmap with a
  # batched Δ the cond is a select: the same values, bit identity not promised.
  return jax.lax.cond(~defined | (c >= keep), lambda delta: delta, corrected, delta)


def align(deltas, momenta, **hyperparameters):
  """`align_block` on every leaf of `deltas` against the leaf of `momenta` at its place."""
  return jax.tree.map(lambda d, m: align_block(d, m, **hyperparameters), deltas, momenta)


def momentum_of(state):
  """The momentum buffer in an outer optimizer's state: Delayed Nesterov's b, or the trace of
  optax's momentum (`optim.outer_nesterov`, `optax.sgd` with momentum); a ValueError unless there
  is exactly one."""
  found = []

  def visit(node):
    if isinstance(node, DelayedNesterovState):
      found.append(node.momentum)
    elif isinstance(node, optax.TraceState):
      found.append(node.trace)
    elif isinstance(node, (tuple, list)):  # chains, NamedTuple states holding inner states
      for child in node:
        visit(child)
    elif isinstance(node, dict):
      for child in node.values():
        visit(child)

  visit(state)
  if len(found) != 1:
    raise ValueError("heloco's outer optimizer must hold one momentum buffer (Nesterov or Delayed "
                     f"Nesterov with momentum > 0), found {len(found)}")
  return found[0]


def heloco(outer: optax.GradientTransformation, keep=DEFAULTS["keep"], shrink=DEFAULTS["shrink"],
           max_shrink=DEFAULTS["max_shrink"], reorient=DEFAULTS["reorient"],
           momentum_weight=DEFAULTS["momentum_weight"], eps=EPS) -> optax.GradientTransformation:
  """`outer` with each update aligned first with the momentum of `outer`'s own state (HeLoCo,
  module doc): ``update(Δ, state) = outer.update(align(Δ, m(state)), state)``.

  Args:
    outer: an outer optimizer with one momentum buffer (`optim.outer_nesterov(η, μ > 0)`,
      `optim.delayed_nesterov(η, μ, N)`).
    keep: c_ok, in [−1, 1]: blocks at least this aligned with m are kept.
    shrink: k_s >= 0, the strength of the anti-aligned shrink.
    max_shrink: β_max in [0, 1], its cap.
    reorient: k_d >= 0, the strength of the weak blocks' turn toward m.
    momentum_weight: κ >= 0, the weight of ‖m_b‖ against ‖Δ_b‖ in the confidence.
    eps: ε > 0.

  Returns:
    An optax transformation whose state is `outer`'s (init is `outer.init`). With m = 0 (the
    first merges) and with every block aligned (c ≥ c_ok) it steps exactly as `outer`.

  References:
    Al Asif et al., HeLoCo: Efficient asynchronous low-communication training under data and
    device heterogeneity, arXiv 2606.00271.
  """
  check_transformation(outer, "heloco's outer")
  hyperparameters = dict(keep=keep, shrink=shrink, max_shrink=max_shrink, reorient=reorient,
                         momentum_weight=momentum_weight, eps=eps)
  check_hyperparameters(hyperparameters)
  checks.number(hyperparameters, "eps", 0, low_open=True)

  def init(params):
    state = outer.init(params)
    momentum_of(state)  # no momentum to align with: said now, not at the first update
    return state

  def update(updates, state, params=None):
    return outer.update(align(updates, momentum_of(state), **hyperparameters), state, params)

  return optax.GradientTransformation(init, update)
