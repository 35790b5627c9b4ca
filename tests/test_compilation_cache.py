"""The persistent compilation cache that the processes of one run share: an entry is visible
whole or not at all (`compat.atomic_compilation_cache_writes`, installed when lowcomm_jax is
imported), so a process never loads a truncated executable another is still writing."""

import os
import pathlib
import threading

import jax
import numpy as np

import lowcomm_jax  # noqa: F401  (installs the atomic writes)
from lowcomm_jax import compat
from lowcomm_jax.compat import lru_cache


def test_a_reader_never_sees_a_partly_written_entry(tmp_path):
  """A writer puts 48 MiB entries under 6 keys while a reader polls the folder: every entry file
  it finds has the full size (JAX's own `put`, writing in place, shows growing files), and no
  temporary file is left."""
  compat.atomic_compilation_cache_writes()  # idempotent: once more changes nothing
  cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
  size, keys = 48 << 20, [f"key{i}" for i in range(6)]
  value = np.random.default_rng(0).integers(0, 255, size, np.uint8).tobytes()
  seen, done = [], threading.Event()

  def read():
    while not done.is_set():
      for entry in os.scandir(tmp_path):
        if entry.name.endswith("-cache"):
          try:
            seen.append(entry.stat().st_size)
          except FileNotFoundError:
            pass

  reader = threading.Thread(target=read)
  reader.start()
  try:
    for key in keys:
      cache.put(key, value)
  finally:
    done.set()
    reader.join()
  assert seen and set(seen) == {size}, sorted(set(seen))[:5]
  assert sorted(p.name for p in pathlib.Path(tmp_path).iterdir()) == sorted(
      f"{k}-cache" for k in keys)
  assert cache.get("key3") == value
  cache.put("key3", b"other")  # an existing entry is kept, as JAX's own put keeps it
  assert cache.get("key3") == value


def test_a_compiled_program_round_trips_through_the_cache(tmp_path):
  """A program compiled into an empty cache folder, then loaded from it by a fresh compile of
  the same program (a cache hit, as JAX's monitoring counts it): the loaded executable computes the
  same values."""
  from jax import monitoring
  from jax.experimental.compilation_cache import compilation_cache
  events = []
  monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
  previous = {k: jax.config.values[k] for k in (
      "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
      "jax_persistent_cache_min_entry_size_bytes")}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  compilation_cache.reset_cache()
  try:
    f = lambda x: jax.numpy.sin(x) * 3.0 + x
    x = np.linspace(-2, 2, 97, dtype=np.float32)
    first = np.asarray(jax.jit(f).lower(x).compile()(x))
    entries = [p.name for p in tmp_path.iterdir()]
    assert any(n.endswith("-cache") for n in entries) and not any(
        n.endswith(".partial") for n in entries), entries
    hits = events.count("/jax/compilation_cache/cache_hits")
    second = np.asarray(jax.jit(lambda x: f(x)).lower(x).compile()(x))
    assert events.count("/jax/compilation_cache/cache_hits") == hits + 1
    np.testing.assert_array_equal(first, second)
  finally:
    for k, v in previous.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()
