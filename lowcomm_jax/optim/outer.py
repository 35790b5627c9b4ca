"""Outer optimizers: ordinary optax transformations applied to the outer gradient Δ = φ − θ.

With this sign, outer SGD with learning rate 1 and no momentum gives
φ ← φ − mean(φ − θ_m) = mean(θ_m): plain parameter averaging.
"""

from __future__ import annotations

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


def check_transformation(tx, option: str) -> None:
  """A clear error when something that is not an optax transformation is passed."""
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"{option} must be an optax.GradientTransformation (with init and update), "
                    f"got {type(tx).__name__}")
