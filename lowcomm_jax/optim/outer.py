"""Outer optimizers: ordinary optax transformations applied to the outer gradient Δ = φ − θ.

With this sign, outer SGD with learning rate 1 and no momentum gives
φ ← φ − mean(φ − θ_m) = mean(θ_m): plain parameter averaging.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


def outer_nesterov(learning_rate=0.7, momentum=0.9) -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: SGD with Nesterov momentum (docs/algorithms.md §1.1).

  .. math::
    b ← μ·b + Δ;  φ ← φ − η·(Δ + μ·b)

  η and μ may be arrays, traced ones included, so `optax.inject_hyperparams(outer_nesterov)(
  learning_rate=..., momentum=...)` can drive them. A Python μ = 0 builds plain SGD (no trace); an
  array μ always keeps the trace (with μ = 0 it gives the same numbers).
  """
  if isinstance(momentum, (int, float)) and not momentum:
    return optax.sgd(learning_rate)
  return optax.sgd(learning_rate, momentum=momentum, nesterov=True)


class DelayedNesterovState(NamedTuple):
  """Delayed Nesterov's state: the momentum b, the sum of the outer gradients since its last
  update, and how many there were (in [0, N))."""
  momentum: optax.Updates
  buffer: optax.Updates
  count: jax.Array


def delayed_nesterov(learning_rate=0.7, momentum=0.9, every: int = 1
                     ) -> optax.GradientTransformation:
  """Nesterov momentum updated only every N = `every` outer gradients (Liu et al., arXiv
  2401.09135, "Delayed Nesterov"; docs/algorithms.md §1.8), for a syncer that merges each
  learner's Δ as it arrives:

  .. math::
    k < N − 1:  φ ← φ − η·Δ/N                        (plain steps; Δ also added to the buffer)
    k = N − 1:  b ← μ·b + (Σ buffered Δ + Δ)/N;  φ ← φ − η·(Δ/N + μ·b)

  where k counts the outer gradients since b's last update. Over N outer gradients the steps add up
  to one Nesterov step of their mean, η·(mean + μ·b): N learners' Δ from one φ, merged one by one,
  give DiLoCo's outer step (up to float32 rounding). N = 1 is `outer_nesterov`, which it returns.
  """
  if every == 1:
    return outer_nesterov(learning_rate, momentum)

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return DelayedNesterovState(zeros, zeros, jnp.zeros([], jnp.int32))

  def update(updates, state, params=None):
    del params
    last = state.count == every - 1  # this outer gradient completes the buffer: b moves
    total = jax.tree.map(lambda s, d: s + d, state.buffer, updates)
    new_momentum = jax.tree.map(lambda b, t: jnp.where(last, t / every + momentum * b, b),
                                state.momentum, total)
    steps = jax.tree.map(lambda d, b: -learning_rate * jnp.where(last, d / every + momentum * b,
                                                                 d / every),
                         updates, new_momentum)
    buffer = jax.tree.map(lambda t: jnp.where(last, jnp.zeros_like(t), t), total)
    count = jnp.where(last, 0, state.count + 1).astype(jnp.int32)
    return steps, DelayedNesterovState(new_momentum, buffer, count)

  return optax.GradientTransformation(init, update)


def check_transformation(tx, option: str) -> None:
  """A clear error when something that is not an optax transformation is passed."""
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"{option} must be an optax.GradientTransformation (with init and update), "
                    f"got {type(tx).__name__}")
