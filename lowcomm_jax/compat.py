"""The private JAX (`jax._src`) that lowcomm_jax reads, in one place.

Each function names what it reads, why the public API cannot do it yet, and what would replace
it. ruff's TID251 rule (pyproject.toml) refuses `jax._src` in every other file, so a new private
use comes here with its note. All of it exists unchanged from jax 0.10.2 to 0.12 (the versions
pyproject.toml allows).
"""

from __future__ import annotations

import os
import re
import uuid

from jax._src import cloud_tpu_init, clusters, lru_cache


def on_cloud_tpu_vm() -> bool:
  """Whether JAX found a Cloud TPU VM's runtime when it started (`cloud_tpu_init`).

  JAX records this when it initializes its TPU backend and uses it in its own cluster detection;
  there is no public query. `jax.devices()[0].platform == "tpu"` is not the same: it starts the
  backend, which `distributed.initialize` must not do before `jax.distributed.initialize`.
  """
  return bool(cloud_tpu_init.running_in_cloud_tpu_vm)


def slurm_or_mpi_cluster() -> type | None:
  """JAX's SLURM or Open MPI cluster description whose environment is present, else None.

  `jax.distributed.initialize()` detects these itself but then restricts each process to the one
  local device its task id names (SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK), which is wrong with
  one task per node holding several devices; no public API returns what it detected without
  initializing. The registry `clusters.ClusterEnv._cluster_types` lists the detectors; the ones
  returned answer `get_coordinator_address`, `get_process_count` and `get_process_id`.
  """
  registry = clusters.ClusterEnv._cluster_types  # pylint: disable=protected-access
  return next((e for e in registry if e.name in ("slurm", "ompi") and e.is_env_present()), None)


def jax_detected_distributed_params() -> tuple:
  """(coordinator address, process count, process id, local device ids) as JAX's own detection
  reads them from the environment, with nothing given: what `jax.distributed.initialize()` would
  use. Tests compare `distributed.initialize_arguments` with it; no public API returns it."""
  unset = (None,) * 6  # address, count, id, local device ids, detection method, timeout
  return clusters.ClusterEnv.auto_detect_unset_distributed_params(*unset)


def tpu_flash_attention_forward(q, k, v, sm_scale: float, block_sizes) -> tuple:
  """(output, row sums l, row maxima m) of jax's Pallas TPU flash attention, causal, operands heads
  first [B, H, T, K]: the forward rule of its `jax.custom_vjp` (`_flash_attention_fwd` of
  `jax.experimental.pallas.ops.tpu.flash_attention`), with the softmax statistics it keeps.

  The public `flash_attention` is differentiable only with operands that vary over no manual mesh
  axis: its kernels' results carry no such type, and its custom_vjp refuses a cotangent of another
  type than its result. Inside the Trainer's `shard_map` over `replica` the model calls the rules
  itself and types their results (`models.attention.tpu_flash_attention`). A public VJP that takes
  such operands would replace these two. Not `jax._src`: the module is public, its rules private.
  """
  from jax.experimental.pallas.ops.tpu import flash_attention  # pylint: disable=g-import-not-at-top
  o, (*_, l, m) = flash_attention._flash_attention_fwd(  # pylint: disable=protected-access
      q, k, v, None, None, False, True, sm_scale, block_sizes, False)
  return o, l, m


def tpu_flash_attention_backward(q, k, v, o, l, m, d_out, sm_scale: float, block_sizes) -> tuple:
  """(dq, dk, dv) of `tpu_flash_attention_forward`'s result given its cotangent `d_out`: the
  backward rule of the same custom_vjp (`_flash_attention_bwd`), from the forward's residuals."""
  from jax.experimental.pallas.ops.tpu import flash_attention  # pylint: disable=g-import-not-at-top
  dq, dk, dv, _, _ = flash_attention._flash_attention_bwd(  # pylint: disable=protected-access
      False, True, sm_scale, block_sizes, False, (q, k, v, None, None, o, l, m), d_out)
  return dq, dk, dv


def atomic_compilation_cache_writes() -> None:
  """Makes JAX's persistent compilation cache write each entry whole or not at all.

  `lru_cache.LRUCache.put` writes an entry in place and, with no size limit set, takes no lock: a
  process that reads the entry while another still writes it loads a truncated executable, and
  XLA aborts that process. The processes of one run share a cache folder (launch_local's
  processes, elastic learners, HDEE's experts, the test suite's workers). Here an entry without
  a size limit is written to a temporary file in the same folder and renamed into place, so a
  reader finds the whole entry or none. A size limit (`jax_compilation_cache_max_size`) would make
  JAX lock instead, at the price of listing the whole folder at every write; with a limit, JAX's
  own `put` runs. Replaced by JAX's own once it writes entries atomically. Idempotent.
  """
  cache = lru_cache.LRUCache
  if getattr(cache.put, "_lowcomm_atomic", False):
    return
  jax_put = cache.put

  def put(self, key: str, value: bytes) -> None:
    if self.eviction_enabled or not key or not str(self.path).startswith(os.sep):
      return jax_put(self, key, value)  # locked (or not a local folder): JAX's own
    final = os.path.join(str(self.path), f"{key}{lru_cache._CACHE_SUFFIX}")  # pylint: disable=protected-access
    if os.path.exists(final):
      return None
    partial = os.path.join(str(self.path), f".{key}.{os.getpid()}.{uuid.uuid4().hex}.partial")
    try:
      with open(partial, "wb") as f:
        f.write(value)
      os.replace(partial, final)
    finally:
      if os.path.exists(partial):
        os.remove(partial)
    return None

  put._lowcomm_atomic = True  # pylint: disable=protected-access
  cache.put = put


def cpu_launch_threads_for_fake_devices() -> int | None:
  """Sets NPROC, the size of XLA's CPU thread pools, to max(cores, 4 N) when XLA presents N > 1
  fake CPU devices (`--xla_force_host_platform_device_count=N` in XLA_FLAGS) and NPROC is unset;
  returns the size set, or None.

  XLA's CPU client runs the per-device launches of a program on a pool of max(cores, N) threads:
  exactly one collective's worth on a machine with fewer cores than devices. A launch whose device
  has its quota of programs in flight waits on a pool thread; when the program that would free the
  quota is queued behind the other devices' launches, which wait in the collective's rendezvous
  for it, no thread is left to run it, and after a minute XLA aborts the process
  (`xla::internal::AwaitAndLogIfStuck`: SIGABRT, no Python error), as on 2 cores with 8 fake
  devices and other work running. Threads to spare remove the wait; idle pool threads cost
  nothing. Read when the CPU client starts: a client that exists keeps its pool. Replaced once
  XLA's CPU client sizes its launch pool for launches that wait.
  """
  if "NPROC" in os.environ:
    return None
  flags = os.environ.get("XLA_FLAGS", "")
  found = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
  if not found or int(found.group(1)) < 2:
    return None
  size = max(os.cpu_count() or 1, 4 * int(found.group(1)))
  os.environ["NPROC"] = str(size)
  return size
