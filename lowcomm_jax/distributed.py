"""Many processes, one program: JAX's multi-controller runtime as the Trainer uses it.

Every process runs the same binary on its own devices; `jax.distributed` joins them into one set
of global devices, and the mesh's `replica` axis is laid across processes (the slow links between
machines or data centres) while `data`, `tensor` and `stage` stay inside a process (fast links).
So a process owns whole replicas: it reads only their data, and the only traffic between processes
is what the algorithm sends over `replica` (DiLoCo's outer all-reduce), plus the small host
gathers of logged metrics and data positions below. CPU collectives go through gloo; GPUs use
NCCL and TPUs ICI/DCN, chosen by JAX, never a transport of ours.

A process that stops answering is found by the runtime's heartbeats: after
`distributed.timeout_seconds` without one, every other process stops with an error naming it
(see `initialize`), instead of waiting in a collective forever.

Process 0's coordinator listens on the host of the coordinator address only (127.0.0.1 for
experiments/launch_local.py), never on every interface unless `--coordinator_bind_address` says
so. A SIGTERM (what SLURM and Kubernetes send before a kill) to any process is a preemption notice:
`Preemption` makes every process agree on one step boundary, where the run saves a checkpoint and
stops with `Preempted` (exit status PREEMPTED_EXIT_CODE); rerunning the command resumes from it.
"""

from __future__ import annotations

import json
import os
import signal
import weakref

import jax
import numpy as np
from jax.experimental import multihost_utils

# Environments where JAX finds the coordinator, the process count and the process id by itself.
_DETECTED_ENVIRONMENTS = {"SLURM_NTASKS": "SLURM", "OMPI_COMM_WORLD_SIZE": "Open MPI"}


def detected_cluster() -> str | None:
  """The name of a multi-process job environment JAX can read (SLURM, Open MPI), or None."""
  for variable, name in _DETECTED_ENVIRONMENTS.items():
    if int(os.environ.get(variable, "1") or 1) > 1:
      return name
  return None


def bind_address(coordinator_address: str | None, requested: str | None = None) -> str | None:
  """Where process 0's coordinator listens: `requested`, else the coordinator address itself
  (its host and port: loopback stays loopback), else None (JAX's choice, for detected clusters)."""
  if requested:
    if ":" not in requested:
      raise ValueError(f"--coordinator_bind_address must be host:port (e.g. 0.0.0.0:1234 for every "
                       f"interface), got {requested!r}")
    return requested
  return (os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or coordinator_address or
          os.environ.get("JAX_COORDINATOR_ADDRESS"))


def initialize(mode: str = "auto", coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               timeout_seconds: int = 60, init_timeout_seconds: int = 300,
               coordinator_bind_address: str | None = None) -> bool:
  """Joins this process to the others; returns whether the run is multi-process.

  mode: `off` stays a single process; `on` always calls `jax.distributed.initialize` (JAX detects
  the coordinator on TPU pod slices, SLURM and Open MPI when the three flags are not given);
  `auto` does so when the flags are given, `JAX_COORDINATOR_ADDRESS` is set, or SLURM/Open MPI
  report more than one task. Must run before anything touches a JAX device.
  coordinator_bind_address: host:port process 0's coordinator listens on; default the coordinator
  address (JAX's own default is every interface, `[::]:port`).

  Raises:
    ValueError: naming the flag, for an unknown mode or flags that contradict each other.
  """
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"--distributed must be auto, on or off, got {mode!r}")
  explicit = (coordinator_address, num_processes, process_id)
  if mode == "off":
    if any(v is not None for v in explicit) or coordinator_bind_address:
      raise ValueError("--distributed=off cannot be combined with --coordinator_address, "
                       "--num_processes or --process_id")
    return False
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    raise ValueError("--coordinator_address, --num_processes and --process_id go together: give "
                     "all three (or none, to let JAX read SLURM, Open MPI or a TPU pod slice), got "
                     f"{coordinator_address!r}, {num_processes!r}, {process_id!r}")
  if num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id must be in [0, {num_processes}) for --num_processes="
                     f"{num_processes}, got {process_id}")
  if mode == "auto" and coordinator_address is None and not (
      os.environ.get("JAX_COORDINATOR_ADDRESS") or detected_cluster()):
    return False
  bind = bind_address(coordinator_address, coordinator_bind_address)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             initialization_timeout=int(init_timeout_seconds),
                             heartbeat_timeout_seconds=int(timeout_seconds),
                             coordinator_bind_address=bind)
  return jax.process_count() > 1


# The exit status of a run stopped by a preemption notice after saving (128 + SIGTERM, as a shell
# reports a process SIGTERM ended): non-zero, so schedulers and launchers see it did not finish.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class Preempted(Exception):
  """Raised after the checkpoint of the step every process agreed on has been saved."""

  def __init__(self, step: int, checkpoint_dir):
    self.step = step
    super().__init__(f"SIGTERM received: stopped after saving the checkpoint of step {step} in "
                     f"{checkpoint_dir}; rerun the same command to resume from it")


def _handler_for(preemption_ref):
  """A SIGTERM handler that tells the run, or, once the run is gone (it ended by an exception
  without `close`), restores the default handler and lets the signal end the process."""

  def handler(signum, frame):
    preemption = preemption_ref()
    if preemption is not None:
      preemption._on_sigterm()  # pylint: disable=protected-access
      return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)

  return handler


class Preemption:
  """Whether a SIGTERM asks the run to save and stop now; asked at every step boundary.

  With several processes JAX's preemption sync service catches the SIGTERM of any of them and
  picks the step every process saves at (the largest step any has reached, plus one), so all
  save the same step; `reached` must then be called at every step by every process. Alone, a
  Python handler records the signal and the next boundary is the step.
  """

  def __init__(self):
    from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
    self.joined = jax_distributed.global_state.client is not None
    self.signalled, self._previous = False, None
    if not self.joined:
      try:
        self._previous = signal.signal(signal.SIGTERM, _handler_for(weakref.ref(self)))
      except ValueError:  # not the main thread: the default handler stays
        self._previous = None

  def _on_sigterm(self) -> None:
    self.signalled = True
    print("SIGTERM received: saving a checkpoint at the end of this step, then stopping", flush=True)

  def reached(self, step: int) -> bool:
    if self.joined:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signalled

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


def is_primary() -> bool:
  """Process 0 writes what exists once per run: config.json, metrics, TensorBoard, summary.json."""
  return jax.process_index() == 0


def check_mesh(mesh, num_replicas: int) -> None:
  """Refuses a mesh whose inner axes would cross a process boundary.

  Each `replica` slot must live inside one process, the processes' slots must be contiguous (so a
  process owns a contiguous block of replicas and feeds only those), and every device is used.

  Raises:
    ValueError: naming `mesh.replica`/`num_replicas` and what the process count allows.
  """
  processes = jax.process_count()
  if processes == 1:
    return
  slots = mesh.devices.shape[0]
  if slots % processes or num_replicas % slots:
    raise ValueError(f"mesh.replica={slots} must be a multiple of the {processes} processes (the "
                     "replica axis spans processes, the inner axes stay inside one), and a divisor "
                     f"of num_replicas={num_replicas}; set --config.mesh.replica={processes} or a "
                     "multiple")
  if mesh.devices.size != len(jax.devices()):
    raise ValueError(f"the mesh uses {mesh.devices.size} of the {len(jax.devices())} devices of "
                     f"the {processes} processes; with several processes it must use them all "
                     "(set one mesh axis to -1)")
  owners = [{d.process_index for d in mesh.devices[r].flat} for r in range(slots)]
  if any(len(o) != 1 for o in owners) or [min(o) for o in owners] != sorted(min(o) for o in owners):
    raise ValueError(f"the mesh's replica slots span processes ({owners}); each process must hold "
                     "whole replicas: give every process the same number of devices")


def local_replicas(mesh, num_replicas: int) -> range:
  """The replicas (indices into [0, M)) whose devices this process owns, in order."""
  slots = mesh.devices.shape[0]
  per_slot = num_replicas // slots
  mine = [r for r in range(slots) if mesh.devices[r].flat[0].process_index == jax.process_index()]
  return range(mine[0] * per_slot, (mine[-1] + 1) * per_slot)


def global_array(local: np.ndarray, sharding, global_shape: tuple) -> jax.Array:
  """A global array from this process's contiguous block of its leading axis (all of it alone)."""
  return jax.make_array_from_process_local_data(sharding, local, global_shape)


def replicated_array(value: np.ndarray, sharding) -> jax.Array:
  """A global array from a host value every process holds whole (e.g. the eval batches)."""
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def fetch(tree):
  """Host numpy values of (possibly cross-process) arrays; every process must call it together."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


def gather_lists(local: list) -> list:
  """The concatenation, in process order, of each process's list of JSON values."""
  if jax.process_count() == 1:
    return list(local)
  encoded = np.frombuffer(json.dumps(local).encode(), np.uint8)
  lengths = np.asarray(multihost_utils.process_allgather(np.int32(encoded.size))).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:encoded.size] = encoded
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
  return [item for row, n in zip(rows, lengths) for item in json.loads(row[:n].tobytes())]


def all_agree(flag: bool) -> bool:
  """True when `flag` holds on every process (so all take the same branch of a collective path)."""
  if jax.process_count() == 1:
    return flag
  return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (nothing to wait for alone)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f"lowcomm_jax: {name}")
