"""Many processes, one program: JAX's multi-controller runtime as the Trainer uses it.

Every process runs the same binary on its own devices; `jax.distributed` joins them into one set
of global devices, and the mesh's `replica` axis is laid across processes (the slow links between
machines or data centres) while `data`, `tensor` and `stage` stay inside a process (fast links).
So a process owns whole replicas: it reads only their data, and the only traffic between processes
is what the algorithm sends over `replica` (DiLoCo's outer all-reduce), plus the small host
gathers of logged metrics and data positions below. CPU collectives go through gloo; GPUs use
NCCL and TPUs ICI/DCN, chosen by JAX, never a transport of ours.

Who joins and with which devices (`initialize_arguments`, docs/clusters.md): explicit flags, SLURM,
Open MPI or a multi-host TPU pod slice; with one process per node each process uses every local
accelerator (JAX's own detection would give it only the one numbered by its local rank).

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

import ipaddress
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.request
import weakref

import jax
import numpy as np
from jax.experimental import multihost_utils

from lowcomm_jax import compat

# Environments where JAX finds the coordinator, the process count and the process id by itself.
_DETECTED_ENVIRONMENTS = {"SLURM_NTASKS": "SLURM", "OMPI_COMM_WORLD_SIZE": "Open MPI"}
# Where a multi-host TPU slice names its hosts (GKE, queued resources) and its slices (multislice).
_TPU_HOST_LISTS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
_METADATA_SECONDS = 2.0  # bound on asking a TPU VM's metadata server for its slice's hosts


def _on_tpu_vm() -> bool:
  return compat.on_cloud_tpu_vm()


def _tpu_hosts_from_metadata() -> int:
  """The hosts of this Cloud TPU VM's slice, from the VM's metadata server (bounded in time)."""
  address = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
  request = urllib.request.Request(
      f"http://{address}/computeMetadata/v1/instance/attributes/worker-network-endpoints",
      headers={"Metadata-Flavor": "Google"})
  with urllib.request.urlopen(request, timeout=_METADATA_SECONDS) as response:
    return len(response.read().decode().strip().split(","))


def tpu_hosts(on_tpu_vm: bool | None = None, metadata=_tpu_hosts_from_metadata) -> int:
  """The number of hosts of this TPU job (slices × hosts per slice); 0 when not on a TPU VM.

  Read from the environment GKE and multislice set, else from the VM's metadata server.

  Raises:
    ValueError: naming `--distributed`, on a TPU VM whose host count cannot be found.
  """
  if not (_on_tpu_vm() if on_tpu_vm is None else on_tpu_vm):
    return 0
  slices = int(os.environ.get("MEGASCALE_NUM_SLICES") or 1)
  names = next((os.environ[v] for v in _TPU_HOST_LISTS if os.environ.get(v)), None)
  if names is not None:
    return slices * len(names.split(","))
  if os.environ.get("TPU_SKIP_MDS_QUERY") is None:
    try:
      return slices * metadata()
    except OSError:
      pass
  raise ValueError("--distributed=auto cannot tell whether this TPU VM is one host or part of a "
                   "multi-host pod slice (no TPU_WORKER_HOSTNAMES and no answer from the metadata "
                   "server): set --distributed=on for a pod slice or --distributed=off for one "
                   "host")


def detected_cluster() -> str | None:
  """The name of a multi-process job environment JAX can read (SLURM, Open MPI, a multi-host TPU
  pod slice), or None."""
  for variable, name in _DETECTED_ENVIRONMENTS.items():
    if int(os.environ.get(variable, "1") or 1) > 1:
      return name
  if tpu_hosts() > 1:
    return "TPU pod slice"
  return None


def tasks_per_node(spec: str) -> list[int]:
  """SLURM's compressed task counts per node (`SLURM_TASKS_PER_NODE`, e.g. "2(x3),1") expanded."""
  counts = []
  for item in spec.split(","):
    count, _, repeat = item.partition("(x")
    counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
  return counts


def one_process_per_node() -> bool:
  """Whether the job environment starts one process per node (SLURM's tasks per node, Open MPI's
  local size), so that process should use every local accelerator."""
  if os.environ.get("SLURM_NTASKS") is not None:
    spec = (os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
            or os.environ.get("SLURM_NTASKS_PER_NODE"))
    return spec is not None and set(tasks_per_node(spec)) == {1}
  if os.environ.get("OMPI_COMM_WORLD_SIZE") is not None:
    return os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") == "1"
  return False


def _slurm_or_mpi_arguments() -> tuple[str, int, int] | None:
  """(coordinator address, process count, process id) as JAX's own detection reads them from
  SLURM or Open MPI, or None when neither is complete."""
  env = compat.slurm_or_mpi_cluster()
  if env is None:
    return None
  address = env.get_coordinator_address(timeout_secs=None,
                                        override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"))
  return address, env.get_process_count(), env.get_process_id()


def parse_host_port(value: str, flag: str) -> tuple[str, int]:
  """(host, port) of `host:port`, `[IPv6]:port` or an IPv4 address and port.

  Raises:
    ValueError: naming `flag` and the allowed forms, for anything else (a bare IPv6 address such
    as `::1`, a port outside 1..65535, an empty host).
  """
  allowed = f"{flag} must be host:port with a port in 1..65535 (IPv6 in brackets: [::1]:1234)"
  if value.startswith("["):
    host, bracket, rest = value[1:].partition("]")
    if not bracket or not rest.startswith(":"):
      raise ValueError(f"{allowed}, got {value!r}")
    try:
      ipaddress.IPv6Address(host)
    except ValueError:
      raise ValueError(f"{allowed}; {host!r} in brackets is not an IPv6 address, "
                       f"got {value!r}") from None
    port = rest[1:]
  else:
    host, colon, port = value.rpartition(":")
    if not colon or not host:
      raise ValueError(f"{allowed}, got {value!r}")
    if ":" in host:
      raise ValueError(f"{allowed}: an IPv6 address goes in brackets, got {value!r}")
    if not _HOSTNAME.fullmatch(host):
      raise ValueError(f"{allowed}; {host!r} is not a host name or address, got {value!r}")
  if not port.isdigit() or not 1 <= int(port) <= 65535:
    raise ValueError(f"{allowed}, got {value!r} (port {port!r})")
  return host, int(port)


_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def bind_address(coordinator_address: str | None, requested: str | None = None) -> str | None:
  """Where process 0's coordinator listens: `requested`, else the coordinator address itself
  (its host and port: loopback stays loopback), else None (JAX's choice, for detected clusters)."""
  if requested:
    parse_host_port(requested, "--coordinator_bind_address")
    return requested
  return (os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or coordinator_address or
          os.environ.get("JAX_COORDINATOR_ADDRESS"))


def initialize_arguments(mode: str = "auto", coordinator_address: str | None = None,
                         num_processes: int | None = None, process_id: int | None = None,
                         timeout_seconds: int = 60, init_timeout_seconds: int = 300,
                         coordinator_bind_address: str | None = None) -> dict | None:
  """The keyword arguments `initialize` passes to `jax.distributed.initialize`, or None for a
  single process. Reads the flags and the environment only; starts nothing.

  Under SLURM or Open MPI with one process per node, the coordinator, process count and id are
  read as JAX reads them, and JAX's detection is turned off (`cluster_detection_method=
  "deactivate"`, no `local_device_ids`): JAX's own would restrict each process to the device
  numbered by its local rank, one of the node's accelerators. With several processes per node
  JAX's one device per process stands.

  Raises:
    ValueError: naming the flag, for an unknown mode, flags that contradict each other or a
    malformed address.
  """
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"--distributed must be auto, on or off, got {mode!r}")
  explicit = (coordinator_address, num_processes, process_id)
  if mode == "off":
    if any(v is not None for v in explicit) or coordinator_bind_address:
      raise ValueError("--distributed=off cannot be combined with --coordinator_address, "
                       "--num_processes or --process_id")
    return None
  if any(v is not None for v in explicit) and any(v is None for v in explicit):
    raise ValueError("--coordinator_address, --num_processes and --process_id go together: give "
                     "all three (or none, to let JAX read SLURM, Open MPI or a TPU pod slice), got "
                     f"{coordinator_address!r}, {num_processes!r}, {process_id!r}")
  if num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id must be in [0, {num_processes}) for --num_processes="
                     f"{num_processes}, got {process_id}")
  if coordinator_address is not None:
    parse_host_port(coordinator_address, "--coordinator_address")
  if mode == "auto" and coordinator_address is None and not (
      os.environ.get("JAX_COORDINATOR_ADDRESS") or detected_cluster()):
    return None
  arguments = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                   process_id=process_id, initialization_timeout=int(init_timeout_seconds),
                   heartbeat_timeout_seconds=int(timeout_seconds))
  detected = (_slurm_or_mpi_arguments()
              if one_process_per_node() and not os.environ.get("JAX_LOCAL_DEVICE_IDS") else None)
  if detected is not None:
    address, count, index = detected
    arguments.update(coordinator_address=coordinator_address or address,
                     num_processes=num_processes or count,
                     process_id=index if process_id is None else process_id,
                     cluster_detection_method="deactivate")
  # A detected cluster's coordinator (a node name) leaves the bind address to JAX (every interface):
  # the name may resolve to a loopback address on its own node.
  arguments["coordinator_bind_address"] = bind_address(coordinator_address,
                                                       coordinator_bind_address)
  return arguments


def wait_for_coordinator(address: str, seconds: float, flag: str = "--coordinator_address") -> None:
  """Returns once a TCP connection to `address` succeeds; tries for `seconds`.

  Raises:
    RuntimeError: naming the address, the flag and the timeout, when nothing answers in time.
  """
  host, port = parse_host_port(address, flag)
  deadline, error = time.monotonic() + seconds, None
  while True:
    try:
      with socket.create_connection((host, port), timeout=max(0.1, min(2.0, seconds))):
        return
    except OSError as e:
      error = e
    if time.monotonic() >= deadline:
      raise RuntimeError(
          f"no coordinator answered at {address} ({flag}) within "
          f"distributed.init_timeout_seconds={seconds:g} s ({error}); is process 0 running and "
          "reachable from this host?")
    time.sleep(0.2)


def initialize(mode: str = "auto", coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               timeout_seconds: int = 60, init_timeout_seconds: int = 300,
               coordinator_bind_address: str | None = None) -> bool:
  """Joins this process to the others; returns whether the run is multi-process.

  mode: `off` stays a single process; `on` always calls `jax.distributed.initialize` (JAX detects
  the coordinator on TPU pod slices, SLURM and Open MPI when the three flags are not given);
  `auto` does so when the flags are given, `JAX_COORDINATOR_ADDRESS` is set, SLURM/Open MPI report
  more than one task, or this is one host of a multi-host TPU pod slice. Must run before anything
  touches a JAX device. The arguments are `initialize_arguments`'s.
  coordinator_bind_address: host:port process 0's coordinator listens on; default the coordinator
  address (JAX's own default is every interface, `[::]:port`).

  A process other than 0 first waits (at most `init_timeout_seconds`) until the coordinator
  accepts a connection, so an unreachable one is reported by its address.

  Raises:
    ValueError: naming the flag, for an unknown mode, flags that contradict each other or a
      malformed address.
    RuntimeError: naming the coordinator address and its flag, when joining fails.
  """
  arguments = initialize_arguments(mode, coordinator_address, num_processes, process_id,
                                   timeout_seconds, init_timeout_seconds, coordinator_bind_address)
  if arguments is None:
    return False
  address = arguments["coordinator_address"]
  flag = ("--coordinator_address" if coordinator_address
          else "from JAX_COORDINATOR_ADDRESS or the cluster's environment")
  if address is not None and arguments["process_id"] not in (None, 0):
    wait_for_coordinator(address, init_timeout_seconds, flag)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX's runtime aborts the process (a C++ check failure) when not every process registered in
  # time; it is given a margin, and a watcher ends the process first with one line that says why.
  joined = _exit_unless_joined(
      init_timeout_seconds,
      f"RuntimeError: not every one of the {arguments['num_processes'] or 'expected'} processes "
      f"joined through the coordinator at {address} ({flag}) within "
      f"distributed.init_timeout_seconds={init_timeout_seconds} s; start them all (the same "
      "--num_processes, each its own --process_id) or raise distributed.init_timeout_seconds")
  arguments["initialization_timeout"] = int(init_timeout_seconds) + _JOIN_MARGIN_SECONDS
  try:
    jax.distributed.initialize(**arguments)
  except Exception as error:  # pylint: disable=broad-except
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise RuntimeError(f"could not join the run through the coordinator at {address} ({flag}) "
                       f"within distributed.init_timeout_seconds={init_timeout_seconds}: "
                       f"{first}") from error
  finally:
    joined.set()
  return jax.process_count() > 1


_JOIN_MARGIN_SECONDS = 30  # JAX's own deadline comes this much after ours


def _exit_unless_joined(seconds: float, message: str) -> threading.Event:
  """An event to set once joined; unless it is set within `seconds`, the process prints `message`
  to stderr and exits with status 1 (the runtime would abort it a little later anyway)."""
  joined = threading.Event()

  def watch():
    if not joined.wait(seconds):
      sys.stderr.write(message + "\n")
      sys.stderr.flush()
      os._exit(1)  # pylint: disable=protected-access

  threading.Thread(target=watch, name="lowcomm_jax join deadline", daemon=True).start()
  return joined


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
    self.joined = jax.distributed.is_initialized()
    self.signalled, self._previous = False, None
    if not self.joined:
      try:
        self._previous = signal.signal(signal.SIGTERM, _handler_for(weakref.ref(self)))
      except ValueError:  # not the main thread: the default handler stays
        self._previous = None

  def _on_sigterm(self) -> None:
    self.signalled = True
    print("SIGTERM received: saving a checkpoint at the end of this step, then stopping",
          flush=True)

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
