"""Bad multi-process flags and config values are refused with one error naming them, before JAX
starts its runtime (these calls never reach jax.distributed)."""

import pytest

from lowcomm_jax import distributed
from lowcomm_jax.testing import tiny_config
from lowcomm_jax.train import Trainer


@pytest.mark.parametrize("args,message", [
    (("sometimes",), r"--distributed must be auto, on or off, got 'sometimes'"),
    (("auto", "127.0.0.1:1234", None, None), r"--coordinator_address, --num_processes and "
                                             r"--process_id go together"),
    (("on", "127.0.0.1:1234", 2, 2), r"--process_id must be in \[0, 2\) for --num_processes=2, got 2"),
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
  with pytest.raises(ValueError, match=r"distributed.timeout_seconds must be >= 1 \(seconds\), got 0"):
    Trainer(tiny_config(**{"distributed.timeout_seconds": 0}), tmp_path / "run")
  assert not (tmp_path / "run").exists()
