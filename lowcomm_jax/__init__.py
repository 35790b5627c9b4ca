"""lowcomm_jax: training language models across loosely connected workers with little
communication."""

from lowcomm_jax import compat
from lowcomm_jax.api import diloco, noloco, outer_nesterov, sparseloco, streaming_diloco

# Processes of one run share a persistent compilation cache: entries written whole (compat).
compat.atomic_compilation_cache_writes()
# Fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N): XLA's CPU launch pool with
# threads to spare, so that a collective's launches cannot starve it (compat).
compat.cpu_launch_threads_for_fake_devices()

__version__ = "0.1.0"

__all__ = ["diloco", "noloco", "outer_nesterov", "sparseloco", "streaming_diloco"]
