"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere.

Many tests compile the same tiny programs (the Trainer builds fresh closures for every run); a
persistent compilation cache shared by the test process and the notebooks' kernels (they inherit the
environment) compiles each distinct program once per test session. The cache folder is this
session's own (made here, inherited by the xdist workers and subprocesses, removed at exit), so two
test runs at once never share it.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _xla_cache = tempfile.mkdtemp(prefix="lowcomm-jax-test-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
  atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # pylint: disable=wrong-import-position

# The small Debian corpora the tests read (the fetch command covers the rest).
DEBIAN_TEST_SOURCES = ("austen", "bible_kjv", "jargon", "fortunes", "r_manuals")


@pytest.fixture(scope="session")
def cache_dir():
  """The corpora cache with the small Debian sources fetched once per session (skip if impossible)."""
  from lowcomm_jax.data import debian  # pylint: disable=g-import-not-at-top
  try:
    return debian.ensure_fetched(DEBIAN_TEST_SOURCES)
  except debian.FetchError as error:
    pytest.skip(f"Debian corpora cannot be fetched here: {error}")
