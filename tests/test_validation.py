"""train.validation: a run's config is checked once into frozen sections, and a gradient source is
reached only through its entry in train.sources.SOURCES (builder + check_config), as algorithms
are."""

import dataclasses

import pytest

from lowcomm_jax import checks, config as config_lib, run_config
from lowcomm_jax.testing import tiny_config
from lowcomm_jax.train import Trainer, algorithms, sources, validation


def test_a_config_is_checked_once_into_frozen_sections(tmp_path, monkeypatch):
  calls = []
  check = validation._check  # pylint: disable=protected-access
  monkeypatch.setattr(validation, "_check", lambda c: (calls.append(c.seed), check(c)))
  c = tiny_config(seed=11, algorithm="streaming_diloco", num_replicas=2,
                  **{"outer.sync_every": 6, "outer.num_fragments": 2})
  run = validation.validate(c)  # experiments/train.py, before any process waits for another
  assert isinstance(run, run_config.RunConfig) and isinstance(run.outer, run_config.OuterConfig)
  assert config_lib.flatten(run) == config_lib.flatten(c)  # every key, its value as given
  assert (run.outer.sync_every, run.outer["num_fragments"], run.mesh.to_dict()) == (
      6, 2, c.mesh.to_dict())
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.outer.sync_every = 3
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.seed = 3
  trainer = Trainer(run, tmp_path / "run")  # takes the checked sections: no second check
  assert calls == [11] and trainer.config is run
  changed = run_config.replace(run, {"outer.sync_every": 4, "seed": 12})
  assert (changed.outer.sync_every, changed.seed, run.outer.sync_every) == (4, 12, 6)
  c.data.seq_len = 1  # a ConfigDict given to the Trainer is checked there
  with pytest.raises(ValueError, match="data.seq_len must be >= 2, got 1"):
    Trainer(c, tmp_path / "refused")
  assert calls == [11, 11] and not (tmp_path / "refused").exists()


def test_a_gradient_source_brings_its_checks_with_it(monkeypatch):
  def check(c):
    checks.require(c.data.batch_size == 4, "data.batch_size", "4 for gradients=replicas4",
                   c.data.batch_size)

  monkeypatch.setitem(sources.SOURCES, "replicas4",
                      sources.Source(sources.SOURCES["replicas"].build, check))
  with pytest.raises(ValueError, match="data.batch_size must be 4 for gradients=replicas4, got 8"):
    validation.validate(tiny_config(gradients="replicas4"))
  validation.validate(tiny_config(gradients="replicas4", **{"data.batch_size": 4}))
  monkeypatch.undo()
  with pytest.raises(ValueError, match=r"gradients must be one of \('replicas', 'skippipe', "
                     r"'pipeline'\), got 'replicas4'"):
    validation.validate(tiny_config(gradients="replicas4", seed=1))


def test_the_sections_each_algorithm_row_declares_drive_the_value_checks(monkeypatch):
  """A section's values are checked in every run because some row reads it: a row that reads
  `noloco` makes noloco.gamma=-1 a mistake in a data-parallel run; without one it is not read."""
  bad = tiny_config(**{"noloco.gamma": -1.0})
  with pytest.raises(ValueError, match=r"^noloco.gamma must be a finite number >= 0, got -1.0$"):
    validation.validate(bad)
  monkeypatch.delitem(algorithms.ALGORITHMS, "noloco")
  assert validation.validate(bad).noloco.gamma == -1.0
  monkeypatch.setitem(algorithms.ALGORITHMS, "gossip",
                      algorithms.Algorithm(None, lambda c: None, ("noloco",)))
  with pytest.raises(ValueError, match=r"^noloco.gamma must be"):
    validation.validate(bad)
