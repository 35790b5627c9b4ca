"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere.

Many tests compile the same tiny programs (the Trainer builds fresh closures for every run); a
persistent compilation cache shared by the test process and the notebooks' kernels (they inherit the
environment) compiles each distinct program once per test session. The cache folder is this
session's own (made here, inherited by the xdist workers and subprocesses, removed at exit), so two
test runs at once never share it.
"""

import atexit
import functools
import gc
import os
import pathlib
import re
import shutil
import tempfile
from importlib import metadata

# XLA's CPU backend with its elemental emitters instead of its fusion emitters where the flag exists
# (jaxlib 0.10; a later XLA has none, and an unknown XLA flag is fatal): about a third less CPU for
# the suite's compiles, in the test processes and everything they start (the environment is
# inherited). A test comparing two different programs asserts the float32 bound of their
# arithmetic, not bit identity, since two programs may fuse alike under one emitter and not under
# the other.
FAST_CPU_COMPILE = (" --xla_cpu_use_fusion_emitters=false"
                    if metadata.version("jaxlib").startswith("0.10.") else "")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8" + FAST_CPU_COMPILE)
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

# Python's cyclic garbage collector, run less often: tracing a step program allocates millions of
# small objects, and with the default thresholds (700, 10, 10) the collector walks JAX's caches
# every few thousand of them; about a seventh of a trainer test's CPU time. Set here for the test
# process and the xdist workers, and through a sitecustomize module on PYTHONPATH for every Python
# process they start (binaries, launched processes, Ray's workers, the notebooks' kernels).
GC_THRESHOLDS = (50_000, 20, 20)
gc.set_threshold(*GC_THRESHOLDS)
if "LOWCOMM_TEST_SITE_DIR" not in os.environ:
  _site = tempfile.mkdtemp(prefix="lowcomm-jax-test-site-")
  pathlib.Path(_site, "sitecustomize.py").write_text(
      f"import gc\ngc.set_threshold(*{GC_THRESHOLDS!r})\n")
  os.environ["LOWCOMM_TEST_SITE_DIR"] = _site
  os.environ["PYTHONPATH"] = os.pathsep.join(
      p for p in (_site, os.environ.get("PYTHONPATH", "")) if p)
  atexit.register(shutil.rmtree, _site, ignore_errors=True)

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


# Every test belongs to one tier, set per file below; a test marked with another tier itself (a
# unit test in a file of processes) keeps its own. The tiers, from the cheapest:
#   unit: pure functions and small compiled programs, the contributor's fast run
#     (`python -m pytest -m unit -n 2`);
#   trainer: runs of the Trainer (steps, checkpoints, resumes) in the test process;
#   lowering: every step program of the allowed cross product, lowered for cuda and tpu;
#   processes: separate processes (the binaries, launch_local, a local Ray cluster);
#   notebooks: colabs/ executed top to bottom;
#   slow: end-to-end runs of a minute or more.
# Each tier has a default per-test timeout (pytest-timeout), so that a hang fails one test, not CI;
# the bounds are far above what a test takes on a loaded 2-core machine, never a measure of speed.
# LOWCOMM_TEST_TIMEOUT_SCALE multiplies them for a run that only gets the CPU others leave idle
# (.ci/run's second leg, at the lowest priority beside the first).
TIER_TIMEOUT_S = {tier: seconds * float(os.environ.get("LOWCOMM_TEST_TIMEOUT_SCALE", "1"))
                  for tier, seconds in {"unit": 300, "trainer": 900, "lowering": 1200,
                                        "processes": 900, "notebooks": 900, "slow": 1800}.items()}
TIERS = {
    "test_accelerator_benchmark.py": "processes",
    "test_accumulation.py": "trainer",
    "test_async_merge.py": "unit",
    "test_bad_inputs.py": "trainer",
    "test_bench.py": "trainer",
    "test_eager.py": "trainer",
    "test_checkpoint_recovery.py": "trainer",
    "test_codec_kernels.py": "unit",
    "test_codecs.py": "unit",
    "test_comm_executor.py": "processes",
    "test_compilation_cache.py": "unit",
    "test_cpu_launch_threads.py": "unit",
    "test_compressed_mean.py": "unit",
    "test_convergence_fidelity.py": "trainer",
    "test_cpu_kernels.py": "unit",
    "test_data.py": "unit",
    "test_data_sources.py": "trainer",
    "test_debian_corpora.py": "unit",
    "test_diloco.py": "trainer",
    "test_docs.py": "unit",
    "test_distributed_flags.py": "unit",
    "test_elastic.py": "processes",
    "test_elastic_benchmark.py": "unit",
    "test_engine.py": "trainer",
    "test_faults.py": "unit",
    "test_fragment_state.py": "trainer",
    "test_hdee_domains.py": "unit",
    "test_hdee_ensemble.py": "unit",
    "test_hdee_experts.py": "trainer",
    "test_hdee_plan.py": "unit",
    "test_launch_local.py": "processes",
    "test_live_readers.py": "processes",
    "test_lowering.py": "lowering",
    "test_lowering_outer.py": "lowering",
    "test_mfu.py": "unit",
    "test_model.py": "unit",
    "test_model_out.py": "trainer",
    "test_model_platforms.py": "unit",
    "test_multiprocess_equivalence.py": "processes",
    "test_multiprocess_faults.py": "processes",
    "test_muon.py": "unit",
    "test_noloco.py": "unit",
    "test_noloco_trainer.py": "trainer",
    "test_notebooks.py": "notebooks",
    "test_overlap_anchor.py": "unit",
    "test_overlap_loop.py": "trainer",
    "test_pipeline_executor.py": "trainer",
    "test_pipeline_routing.py": "unit",
    "test_run_inputs.py": "trainer",
    "test_sim_clock.py": "unit",
    "test_sim_latency.py": "unit",
    "test_sim_network.py": "unit",
    "test_sim_utilization.py": "unit",
    "test_skippipe_scheduler.py": "unit",
    "test_skippipe_simulator.py": "unit",
    "test_skippipe_topology.py": "unit",
    "test_skippipe_training.py": "unit",
    "test_sparseloco.py": "trainer",
    "test_sparseloco_compression.py": "unit",
    "test_startup.py": "unit",
    "test_streaming.py": "trainer",
    "test_train.py": "trainer",
    "test_validation.py": "unit",
    "test_virtual_clock.py": "trainer",
    "test_writer_binaries.py": "processes",
}
# `--dist loadfile` hands the files out heaviest tier first (a file of a heavier tier takes longer
# than any file of a lighter one, roughly; a file counts with the heaviest tier among its tests), so
# that the long files start early and the two workers end within about the last small file of each
# other. Among the files of one tier, more tests first.
TIER_ORDER = ("slow", "notebooks", "lowering", "processes", "trainer", "unit")


def pytest_configure(config):
  for tier in TIER_ORDER:
    config.addinivalue_line("markers", f"{tier}: tests of the {tier} tier (tests/conftest.py)")


def _tier_of_file(path) -> str:
  name = os.path.basename(str(path))
  if name not in TIERS:
    raise pytest.UsageError(
        f"tests/{name} has no tier: add it to TIERS in tests/conftest.py (one of "
        f"{', '.join(reversed(TIER_ORDER))})")
  return TIERS[name]


def pytest_collection_modifyitems(config, items):
  """Marks each test with its tier (its file's, unless marked itself) and the tier's timeout."""
  del config
  for item in items:
    own = [m.name for m in item.iter_markers() if m.name in TIER_TIMEOUT_S]
    if len(set(own)) > 1:
      raise pytest.UsageError(f"{item.nodeid} is marked with several tiers: {sorted(set(own))}")
    tier = own[0] if own else _tier_of_file(item.path)
    if not own:
      item.add_marker(getattr(pytest.mark, tier))
    if item.get_closest_marker("timeout") is None:
      item.add_marker(pytest.mark.timeout(TIER_TIMEOUT_S[tier]))


@functools.lru_cache(maxsize=None)
def _heaviest_tier(scope: str) -> int:
  """The rank in TIER_ORDER (0: heaviest) of the heaviest tier of the tests in file `scope`: its
  own, or one that a test of it is marked with (the xdist controller sees file names, not marks)."""
  ranks = [TIER_ORDER.index(TIERS.get(os.path.basename(scope), "unit"))]
  path = pathlib.Path(scope)
  if path.is_file():
    ranks += [TIER_ORDER.index(t) for t in re.findall(r"@pytest\.mark\.(\w+)", path.read_text())
              if t in TIER_ORDER]
  return min(ranks)


def _file_weight(scope: str, tests: dict) -> tuple[int, int]:
  return (len(TIER_ORDER) - _heaviest_tier(scope), len(tests))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile` handing out the files heaviest tier first (TIER_ORDER)."""
  if config.getoption("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=g-import-not-at-top

  class HeaviestTierFirst(LoadFileScheduling):

    def _assign_work_unit(self, node):
      heaviest = max(self.workqueue, key=lambda scope: _file_weight(scope, self.workqueue[scope]))
      self.workqueue.move_to_end(heaviest, last=False)
      super()._assign_work_unit(node)

  return HeaviestTierFirst(config, log)


_TIER_SECONDS: dict = {}  # tier -> [tests, seconds of setup + call + teardown summed]


def pytest_runtest_logreport(report):
  """Adds each test's phases to its tier's total (on the xdist controller: the workers' reports)."""
  tier = next((t for t in TIER_ORDER if t in report.keywords), None)
  if tier is None:
    return
  total = _TIER_SECONDS.setdefault(tier, [0, 0.0])
  total[0] += report.when == "call" or (report.when == "setup" and report.skipped)
  total[1] += report.duration


def pytest_terminal_summary(terminalreporter):
  """One line: each tier's tests and the seconds they took, summed over the workers (a tier's
  wall time with `-n 2` is about half its sum)."""
  if _TIER_SECONDS:
    terminalreporter.write_line("tier seconds (summed over workers): " + ", ".join(
        f"{t} {_TIER_SECONDS[t][1]:.0f} s ({_TIER_SECONDS[t][0]} tests)"
        for t in reversed(TIER_ORDER) if t in _TIER_SECONDS))
