"""Outer optimizers: ordinary optax transformations applied to the outer gradient Δ = φ − θ.

With this sign, outer SGD with learning rate 1 and no momentum gives
φ ← φ − mean(φ − θ_m) = mean(θ_m): plain parameter averaging.
"""

from __future__ import annotations

import optax


def outer_nesterov(learning_rate: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: SGD with Nesterov momentum (docs/algorithms.md §1.1).

  .. math::
    b ← μ·b + Δ;  φ ← φ − η·(Δ + μ·b)
  """
  return optax.sgd(learning_rate, momentum=momentum or None, nesterov=bool(momentum))


def check_transformation(tx, option: str) -> None:
  """A clear error when something that is not an optax transformation is passed."""
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"{option} must be an optax.GradientTransformation (with init and update), "
                    f"got {type(tx).__name__}")
