"""lowcomm_jax: training language models across loosely connected workers with little
communication."""

from lowcomm_jax import compat
from lowcomm_jax.api import diloco, noloco, outer_nesterov, sparseloco, streaming_diloco

# Processes of one run share a persistent compilation cache: entries written whole (compat).
compat.atomic_compilation_cache_writes()

__version__ = "0.1.0"

__all__ = ["diloco", "noloco", "outer_nesterov", "sparseloco", "streaming_diloco"]
