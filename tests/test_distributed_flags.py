"""Bad multi-process flags and config values are refused with one error naming them, before JAX
starts its runtime (these calls never reach jax.distributed)."""

import re
import socket
import subprocess
import sys

import pytest

from lowcomm_jax import compat, distributed
from lowcomm_jax.testing import CONFIGS, ROOT, tiny_config
from lowcomm_jax.train import Trainer


@pytest.mark.parametrize("args,message", [
    (("sometimes",), r"--distributed must be auto, on or off, got 'sometimes'"),
    (("auto", "127.0.0.1:1234", None, None), r"--coordinator_address, --num_processes and "
                                             r"--process_id go together"),
    (("on", "127.0.0.1:1234", 2, 2),
     r"--process_id must be in \[0, 2\) for --num_processes=2, got 2"),
    (("off", "127.0.0.1:1234", 2, 0), r"--distributed=off cannot be combined"),
])
def test_bad_flags_are_named(args, message):
  with pytest.raises(ValueError, match=message):
    distributed.initialize(*args)


def test_auto_without_a_cluster_stays_one_process(monkeypatch):
  for variable in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(variable, raising=False)
  assert distributed.initialize("auto") is False
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert distributed.detected_cluster() == "SLURM"


def test_timeouts_must_be_positive(tmp_path):
  with pytest.raises(ValueError,
                     match=r"distributed.timeout_seconds must be >= 1 \(seconds\), got 0"):
    Trainer(tiny_config(**{"distributed.timeout_seconds": 0}), tmp_path / "run")
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("address,message", [
    ("::1",
     r"--coordinator_address must be host:port .*an IPv6 address goes in brackets, got '::1'"),
    ("::1:1234", r"--coordinator_address .*an IPv6 address goes in brackets"),
    ("localhost", r"--coordinator_address must be host:port with a port in 1\.\.65535"),
    ("127.0.0.1:99999", r"--coordinator_address must be host:port with a port in 1\.\.65535"),
    (":1234", r"--coordinator_address must be host:port"),
])
def test_bad_coordinator_addresses_are_named(address, message):
  with pytest.raises(ValueError, match=message):
    distributed.initialize("on", address, 2, 0)


@pytest.mark.parametrize("address,host_port", [
    ("127.0.0.1:1234", ("127.0.0.1", 1234)), ("[::1]:443", ("::1", 443)),
    ("node-017.cluster:65535", ("node-017.cluster", 65535)), ("[fe80::1]:1", ("fe80::1", 1)),
])
def test_good_addresses_parse(address, host_port):
  assert distributed.parse_host_port(address, "--coordinator_address") == host_port


_CLUSTER_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_LOCAL_DEVICE_IDS",
                      "JAX_COORDINATOR_BIND_ADDRESS", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS",
                      "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                      "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "MEGASCALE_NUM_SLICES",
                      "TPU_SKIP_MDS_QUERY")
# srun on 4 nodes gpu017..gpu020, this task the third (process 2), first on its node.
_SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[017-020]", "SLURM_NTASKS": "4",
          "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "4"}
_SLURM_PORT = 4242 % 4096 + 61440  # JAX's port for a SLURM job: its id in [61440, 65535]


def _environment(monkeypatch, **variables):
  for variable in _CLUSTER_VARIABLES:
    monkeypatch.delenv(variable, raising=False)
  for variable, value in variables.items():
    monkeypatch.setenv(variable, value)


@pytest.mark.parametrize("tasks", [{"SLURM_STEP_TASKS_PER_NODE": "1(x4)"},
                                   {"SLURM_TASKS_PER_NODE": "1(x4)"},
                                   {"SLURM_NTASKS_PER_NODE": "1"}])
def test_slurm_one_task_per_node_uses_every_local_device(monkeypatch, tasks):
  _environment(monkeypatch, **_SLURM, **tasks)
  # What JAX's own detection does: this task sees only device SLURM_LOCALID=0 of its node.
  assert compat.jax_detected_distributed_params() == (f"gpu017:{_SLURM_PORT}", 4, 2, [0])
  # Ours: the same coordinator and ids, and JAX's detection off, so every local device is used.
  assert distributed.initialize_arguments(
    "auto", timeout_seconds=30, init_timeout_seconds=90
  ) == dict(
    coordinator_address=f"gpu017:{_SLURM_PORT}",
    num_processes=4,
    process_id=2,
    initialization_timeout=90,
    heartbeat_timeout_seconds=30,
    cluster_detection_method="deactivate",
    coordinator_bind_address=None,
  )
  # Explicit flags stand, and still no restriction to one device.
  explicit = distributed.initialize_arguments("on", "10.0.0.7:1234", 4, 1)
  assert (explicit["coordinator_address"], explicit["num_processes"], explicit["process_id"],
          explicit["cluster_detection_method"], explicit["coordinator_bind_address"]) == (
              "10.0.0.7:1234", 4, 1, "deactivate", "10.0.0.7:1234")
  assert "local_device_ids" not in explicit


def test_slurm_several_tasks_per_node_keep_one_device_each(monkeypatch):
  _environment(monkeypatch, **{**_SLURM, "SLURM_NTASKS": "16"},
               SLURM_STEP_TASKS_PER_NODE="4(x3),2,2")
  assert distributed.tasks_per_node("4(x3),2,2") == [4, 4, 4, 2, 2]
  assert distributed.initialize_arguments("auto") == dict(  # JAX's detection: device SLURM_LOCALID
      coordinator_address=None, num_processes=None, process_id=None, initialization_timeout=300,
      heartbeat_timeout_seconds=60, coordinator_bind_address=None)


def test_open_mpi_one_rank_per_node_is_told_apart(monkeypatch):
  _environment(monkeypatch, OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_SIZE="1")
  assert distributed.one_process_per_node()
  monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
  assert not distributed.one_process_per_node()


def test_tpu_pod_slices_are_detected(monkeypatch):
  _environment(monkeypatch)
  assert distributed.tpu_hosts(on_tpu_vm=False) == 0
  assert distributed.tpu_hosts(on_tpu_vm=True, metadata=lambda: 1) == 1  # one host: no runtime
  assert distributed.tpu_hosts(on_tpu_vm=True, metadata=lambda: 4) == 4  # GCE: the metadata server
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1k-0,t1k-1,t1k-2,t1k-3")  # GKE
  monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
  assert distributed.tpu_hosts(on_tpu_vm=True) == 8
  monkeypatch.setattr(distributed, "_on_tpu_vm", lambda: True)
  assert distributed.detected_cluster() == "TPU pod slice"
  # JAX reads the pod
  assert distributed.initialize_arguments("auto")["coordinator_address"] is None


def test_a_tpu_vm_of_unknown_size_asks_for_the_flag(monkeypatch):
  _environment(monkeypatch)

  def no_answer():
    raise OSError("timed out")

  with pytest.raises(ValueError,
                     match=r"--distributed=auto cannot tell .* set --distributed=on for "
                                       r"a pod slice or --distributed=off for one host"):
    distributed.tpu_hosts(on_tpu_vm=True, metadata=no_answer)


def _closed_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.timeout(120)  # it gives up after its 1 s: a wait without an end fails here
def test_an_unreachable_coordinator_is_named_within_the_timeout(monkeypatch):
  _environment(monkeypatch)
  address = f"127.0.0.1:{_closed_port()}"
  with pytest.raises(RuntimeError, match=re.escape(
      f"no coordinator answered at {address} (--coordinator_address) within "
      "distributed.init_timeout_seconds=1 s")):
    distributed.initialize("on", address, 2, 1, init_timeout_seconds=1)


@pytest.mark.processes  # starts a binary: not in the fast tier
@pytest.mark.parametrize("flags,line", [
    (["--coordinator_address=::1", "--num_processes=2", "--process_id=0"],
     "ValueError: --coordinator_address must be host:port with a port in 1..65535 (IPv6 in "
     "brackets: [::1]:1234): an IPv6 address goes in brackets, got '::1'"),
    (["--coordinator_address=127.0.0.1:PORT", "--num_processes=2", "--process_id=1",
      "--config.distributed.init_timeout_seconds=2"],
     "RuntimeError: no coordinator answered at 127.0.0.1:PORT (--coordinator_address) within "
     "distributed.init_timeout_seconds=2 s"),
    # process 0 alone: the runtime would abort it (a C++ check failure, status 134)
    (["--coordinator_address=127.0.0.1:PORT", "--num_processes=2", "--process_id=0",
      "--config.distributed.init_timeout_seconds=2"],
     "RuntimeError: not every one of the 2 processes joined through the coordinator at "
     "127.0.0.1:PORT (--coordinator_address) within distributed.init_timeout_seconds=2 s; start "
     "them all"),
])
def test_the_binary_reports_distributed_errors_in_one_line(tmp_path, flags, line):
  port = str(_closed_port())
  proc = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "train.py"), f"--config={CONFIGS / 'dp.py'}:tiny",
       f"--workdir={tmp_path / 'run'}", *[f.replace("PORT", port) for f in flags]],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].startswith(line.replace("PORT", port)), proc.stderr[
    -2000:
  ]
  assert "Traceback" not in proc.stderr and "Check failure" not in proc.stderr
  assert not (tmp_path / "run").exists()
