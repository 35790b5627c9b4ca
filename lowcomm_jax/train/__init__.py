"""Training: pure step builders and the Trainer."""

from lowcomm_jax.train.trainer import Trainer, run

__all__ = ["Trainer", "run"]
