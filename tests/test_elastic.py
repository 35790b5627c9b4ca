"""Elastic learners on a real local Ray cluster (127.0.0.1): equivalence, faults, bad input."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest

from lowcomm_jax import config as config_lib
from lowcomm_jax.elastic import faults as faults_lib
from lowcomm_jax.elastic import options

CONFIGS = pathlib.Path(__file__).parent.parent / "experiments" / "configs"


def _config(**changes):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("elastic_config", CONFIGS / "elastic.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("tiny")
  base = {"num_steps": 15, "diloco.sync_every": 5, "data.seq_len": 32, "data.batch_size": 4,
          "eval.batch_size": 4, "eval.num_batches": 1, "eval.every": 1000, "log_every": 5,
          "checkpoint.every": 5, "checkpoint.keep": 3, "elastic.num_learners": 2,
          "elastic.min_quorum": 0, "num_replicas": 2, "progress_bar": False}
  return config_lib.override(c, {**base, **changes})


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
  from lowcomm_jax.elastic import driver as run_lib  # pylint: disable=g-import-not-at-top
  ray, started = run_lib.start_ray("", 4, str(tmp_path_factory.mktemp("ray")))
  yield ray
  if started:
    ray.shutdown()


def _spmd_globals(config, workdir):
  """φ after each round of the SPMD run of `config` (checkpoints every H steps)."""
  from lowcomm_jax.train import checkpoint, trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  spmd = options.spmd_config(config)
  trainer = trainer_lib.Trainer(spmd, workdir)
  summary = trainer.run()
  ckpt = checkpoint.Checkpointer(pathlib.Path(workdir), spmd.checkpoint.keep)
  globals_ = []
  for step in sorted(ckpt.manager.all_steps()):
    state, _ = ckpt.restore(step, trainer.abstract_state())
    globals_.append(jax.device_get(trainer.source.eval_params(state)))
  ckpt.close()
  return globals_, summary


def _syncer_globals(workdir):
  """φ after each round of an elastic run (the syncer saves after every round)."""
  from lowcomm_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  ckpt = checkpoint.Checkpointer(pathlib.Path(workdir) / "syncer", 10)
  found = []
  for step in sorted(ckpt.manager.all_steps()):
    restored = ckpt.manager.restore(step)
    found.append(jax.tree.map(np.asarray, dict(restored["state"])["phi"]))
  ckpt.close()
  return found


def test_no_faults_and_full_quorum_equal_the_spmd_run(ray_cluster, tmp_path):
  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  config = _config()
  summary = elastic.run(config, tmp_path / "elastic")
  spmd, spmd_summary = _spmd_globals(config, tmp_path / "spmd")
  rounds = _syncer_globals(tmp_path / "elastic")
  assert len(rounds) == len(spmd) == 3
  for r, (ours, theirs) in enumerate(zip(rounds, spmd)):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      # float32 rounding of 5 r inner steps (θ + (θ' − θ) vs θ', the mean's sum order): a few
      # units in the last place of the parameters' scale per step, the budget 8 ulp per step
      bound = 8 * np.finfo(np.float32).eps * float(np.abs(b).max()) * 5 * (r + 1)
      assert float(np.abs(a - b).max()) <= bound, (r, jax.tree_util.keystr(path))
  assert summary["goodput"] == 1.0 and summary["participation"] == 1.0
  assert summary["deaths"] == [] and summary["rounds"] == [3]
  np.testing.assert_allclose(summary["final_eval_loss"], spmd_summary["final_eval_loss"], rtol=1e-4)
  # bytes on the wire: each learner sends Δ (float32, the whole model) and receives φ every round
  param_bytes = 4 * spmd_summary["num_params"]
  assert summary["bytes_sent_per_learner"] == [3 * param_bytes] * 2
  assert summary["bytes_received_per_learner"] == [3 * param_bytes] * 2
  lines = [json.loads(l) for l in (tmp_path / "elastic" / "metrics.jsonl").read_text().splitlines()]
  assert [l["step"] for l in lines if "participation" in l] == [5, 10, 15]


def test_bad_input_is_refused_before_anything_starts(tmp_path):
  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  cases = {
      "elastic.min_quorum": (3, "elastic.min_quorum must be an integer in [0, 3)"),
      "elastic.grace_s": (-1.0, "elastic.grace_s must be"),
      "elastic.faults": ("explode:learner=0:step=3", "elastic.faults: unknown fault kind 'explode'"),
      "algorithm": ("noloco", "algorithm must be one of diloco, streaming_diloco for an elastic run"),
  }
  for key, (value, message) in cases.items():
    workdir = tmp_path / key
    with pytest.raises(ValueError) as error:
      elastic.run(_config(**{key: value}), workdir)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert not workdir.exists()
  with pytest.raises(ValueError, match="learner must be in \\[0, 2\\)"):
    faults_lib.parse("kill:learner=2:step=4", 2)


def test_fault_specs_and_poisson_schedule():
  parsed = faults_lib.parse("kill:learner=1:step=25, stop:learner=0:step=3:seconds=2.5,"
                            "slow:learner=1:step=1:factor=3,kill_syncer:round=2", 2)
  assert [f.kind for f in parsed] == ["kill", "stop", "slow", "kill_syncer"]
  assert parsed[1].seconds == 2.5 and parsed[2].factor == 3.0 and parsed[3].round == 2
  kills = faults_lib.poisson_kills(3600.0, 2000.0, 4, seed=0)  # rate 1/s over 2,000 s
  assert abs(len(kills) - 2000) < 4 * np.sqrt(2000)  # Poisson: mean 2,000, sd 45
  assert sorted({i for _, i in kills}) == [0, 1, 2, 3]
  assert all(a < b for (a, _), (b, _) in zip(kills, kills[1:]))
