"""A damaged newest checkpoint is detected and the previous complete one restored, with a log line."""

import jax
import numpy as np
import pytest

from lowcomm_jax.train import Trainer
from lowcomm_jax.testing import tiny_config


def damage(step_dir, how: str) -> None:
  files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size > 0)
  assert files, step_dir
  if how == "truncated":  # every file cut to half its size, as a disk-full or torn write leaves it
    for p in files:
      p.write_bytes(p.read_bytes()[:p.stat().st_size // 2])
  else:  # the array data gone, as a partial copy or an interrupted clean-up leaves it
    for p in files:
      if "state" in p.relative_to(step_dir).parts:
        p.unlink()


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, how):
  c = tiny_config(num_steps=8, **{"checkpoint.every": 2, "checkpoint.keep": 3})
  full = Trainer(c, tmp_path / "full")
  full.run()
  Trainer(tiny_config(num_steps=8, stop_at_step=6, **{"checkpoint.every": 2, "checkpoint.keep": 3}),
          tmp_path / "run").run()
  damage(tmp_path / "run" / "checkpoints" / "6", how)
  # A save killed before its rename leaves only a temporary directory: never a step to restore.
  (tmp_path / "run" / "checkpoints" / "8.orbax-checkpoint-tmp-1").mkdir()
  capsys.readouterr()

  resumed = Trainer(c, tmp_path / "run")
  resumed.run()
  out = capsys.readouterr().out
  assert f"checkpoint step 6 in {tmp_path / 'run' / 'checkpoints'} cannot be restored" in out
  assert "restoring the previous complete one" in out
  assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/4" in out
  assert (tmp_path / "run" / "checkpoints_unreadable" / "6").is_dir()
  for a, b in zip(jax.tree.leaves(full.final_state), jax.tree.leaves(resumed.final_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
