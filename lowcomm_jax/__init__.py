"""lowcomm_jax: training language models across loosely connected workers with little communication."""

__version__ = "0.1.0"
