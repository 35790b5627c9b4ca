"""lowcomm_jax: training language models across loosely connected workers with little
communication."""

from lowcomm_jax.api import diloco, noloco, outer_nesterov, sparseloco, streaming_diloco

__version__ = "0.1.0"

__all__ = ["diloco", "noloco", "outer_nesterov", "sparseloco", "streaming_diloco"]
