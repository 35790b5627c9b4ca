"""train.validation: a run's config is checked once, and a gradient source is reached only through
its entry in train.sources.SOURCES (builder + check_config), as algorithms are."""

import pytest

from lowcomm_jax import checks
from lowcomm_jax.testing import tiny_config
from lowcomm_jax.train import Trainer, sources, validation


def test_a_config_is_checked_once_and_every_new_value_again(tmp_path, monkeypatch):
  calls = []
  check = validation._check  # pylint: disable=protected-access
  monkeypatch.setattr(validation, "_check", lambda c: (calls.append(c.seed), check(c)))
  monkeypatch.setattr(validation, "_last_valid", None)
  c = tiny_config(seed=11)
  validation.validate(c)  # experiments/train.py, before any process waits for another
  Trainer(c, tmp_path / "run")  # the Trainer's own check: the same values, not checked again
  assert calls == [11]
  c.seed = 12
  validation.validate(c)
  c.data.seq_len = 1  # a bad value after good ones: refused all the same
  with pytest.raises(ValueError, match="data.seq_len must be >= 2, got 1"):
    Trainer(c, tmp_path / "refused")
  assert calls == [11, 12, 12] and not (tmp_path / "refused").exists()


def test_a_gradient_source_brings_its_checks_with_it(monkeypatch):
  def check(c):
    checks.require(c.data.batch_size == 4, "data.batch_size", "4 for gradients=replicas4",
                   c.data.batch_size)

  monkeypatch.setitem(sources.SOURCES, "replicas4",
                      sources.Source(sources.SOURCES["replicas"].build, check))
  monkeypatch.setattr(validation, "_last_valid", None)
  with pytest.raises(ValueError, match="data.batch_size must be 4 for gradients=replicas4, got 8"):
    validation.validate(tiny_config(gradients="replicas4"))
  validation.validate(tiny_config(gradients="replicas4", **{"data.batch_size": 4}))
  monkeypatch.undo()
  with pytest.raises(ValueError, match=r"gradients must be one of \('replicas', 'skippipe', "
                     r"'pipeline'\), got 'replicas4'"):
    validation.validate(tiny_config(gradients="replicas4", seed=1))
