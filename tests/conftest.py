"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere.

Many tests compile the same tiny programs (the Trainer builds fresh closures for every run); a
persistent compilation cache shared by the test process and the notebooks' kernels (they inherit the
environment) compiles each distinct program once per test session.
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "lowcomm-jax-test-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
