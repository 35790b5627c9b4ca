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
# XLA's CPU backend without LLVM's expensive passes (the launched processes run so too,
# lowcomm_jax.testing.launch_script): the HLO passes are the same, so every compiled program's HLO
# is unchanged, and a tiny model's program compiles in about half the time while its run is no
# slower that matters. Set before jax starts, inherited by the xdist workers, subprocesses and
# notebooks.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import pytest  # pylint: disable=wrong-import-position

# The small Debian corpora the tests read (the fetch command covers the rest).
DEBIAN_TEST_SOURCES = ("austen", "bible_kjv", "jargon", "fortunes", "r_manuals")


@pytest.fixture(scope="session")
def cache_dir():
  """The corpora cache with the small Debian sources fetched once per session (skip if
  impossible)."""
  from lowcomm_jax.data import debian  # pylint: disable=g-import-not-at-top
  try:
    return debian.ensure_fetched(DEBIAN_TEST_SOURCES)
  except debian.FetchError as error:
    pytest.skip(f"Debian corpora cannot be fetched here: {error}")


# `--dist loadfile` (the README's test command) sends each file to one worker, and xdist hands the
# files out in order of their number of tests: a slow file with few tests (the lowering battery's
# halves, the notebooks) would start last and leave the other worker idle at the end. Handed out
# longest first instead (the longest-processing-time rule), the two workers end within about the
# last small file of each other. Seconds per file, roughly as measured in CI on a 2-core machine;
# a file not listed counts one second per test (xdist's own order among the small ones).
FILE_SECONDS = {
    "test_engine.py": 360, "test_notebooks.py": 330, "test_overlap_loop.py": 220,
    "test_streaming.py": 150, "test_lowering.py": 145, "test_lowering_outer.py": 135,
    "test_multiprocess_faults.py": 90, "test_diloco.py": 80, "test_noloco_trainer.py": 55,
    "test_hdee_experts.py": 50, "test_fragment_state.py": 50,
    "test_multiprocess_equivalence.py": 45,
    "test_train.py": 40, "test_sparseloco.py": 40, "test_elastic.py": 220,
}


def _file_seconds(scope: str, tests: dict) -> float:
  return FILE_SECONDS.get(scope.rsplit("/", 1)[-1], len(tests))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile` handing out the files longest first (FILE_SECONDS)."""
  if config.getoption("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=g-import-not-at-top

  class LongestFileFirst(LoadFileScheduling):

    def _assign_work_unit(self, node):
      longest = max(self.workqueue, key=lambda scope: _file_seconds(scope, self.workqueue[scope]))
      self.workqueue.move_to_end(longest, last=False)
      super()._assign_work_unit(node)

  return LongestFileFirst(config, log)
