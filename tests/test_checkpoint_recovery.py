"""A damaged newest checkpoint is detected, set aside with a log line naming it, and the previous
one restored: the resumed run then ends bit-identical to an uninterrupted one.

Damage of every kind a disk, a copy or a hand can do: one flipped bit in a compressed array chunk,
files truncated, a file deleted, the data iterator's JSON edited into valid but wrong JSON, a
garbage manifest, a step whose save never finished (no checksum), an intact step renamed, and an
intact step of a run of another config copied in.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from lowcomm_jax import codecs, distributed, testing
from lowcomm_jax.testing import CONFIGS, ROOT, tiny_config, tree_hash
from lowcomm_jax.train import Trainer, checkpoint

CHANGES = {"num_steps": 8, "checkpoint.every": 2, "checkpoint.keep": 3}


def largest_array_chunk(step_dir):
  return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
             key=lambda p: p.stat().st_size)


def damage(step_dir, how: str, other_run) -> str:
  """Damages a step directory; returns what the log line must name."""
  if how == "bit_flip":  # one bit in the middle of the largest compressed array chunk
    chunk = largest_array_chunk(step_dir)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    return str(chunk.relative_to(step_dir))
  if how == "truncated":  # cut to half its size, as a disk-full or torn write leaves it
    chunk = largest_array_chunk(step_dir)
    chunk.write_bytes(chunk.read_bytes()[:chunk.stat().st_size // 2])
    return str(chunk.relative_to(step_dir))
  if how == "missing":  # as a partial copy or an interrupted clean-up leaves it
    chunk = largest_array_chunk(step_dir)
    chunk.unlink()
    return str(chunk.relative_to(step_dir))
  if how == "wrong_metadata":  # valid JSON, wrong value: the data iterator back at its start
    metadata = step_dir / "data" / "metadata"
    data_state = json.loads(metadata.read_text())
    data_state["replicas"][0]["next_index"] = 0
    metadata.write_text(json.dumps(data_state))
    return "data/metadata"
  if how == "garbage_manifest":
    (step_dir / "state" / "manifest.ocdbt").write_bytes(b"\x00garbage" * 8)
    return "state/manifest.ocdbt"
  if how == "unsealed":  # the save finished but the checksum was never written (killed between)
    (step_dir / checkpoint.CHECKSUM_FILE).unlink()
    return checkpoint.CHECKSUM_FILE
  if how == "renamed":  # an intact earlier step copied to the newest one's name
    shutil.rmtree(step_dir)
    shutil.copytree(step_dir.parent / "2", step_dir)
    return "it was saved as step 2, not 6"
  if how == "another_run":  # the same step of a run of another config (lr 1e-3), intact
    shutil.rmtree(step_dir)
    shutil.copytree(other_run / "checkpoints" / step_dir.name, step_dir)
    return "it was saved by another run"
  raise ValueError(how)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """An uninterrupted run of 8 steps, one stopped after step 6 (checkpoints 2, 4, 6), and one of
  another learning rate stopped there too."""
  root = tmp_path_factory.mktemp("recovery")
  full = Trainer(tiny_config(**CHANGES), root / "full")
  _, full_final = testing.run_to_end(full)
  Trainer(tiny_config(stop_at_step=6, **CHANGES), root / "stopped").run()
  Trainer(tiny_config(**{**CHANGES, "stop_at_step": 6, "optimizer.learning_rate": 1e-3}),
          root / "other").run()
  return full_final.state, root / "stopped", root / "full", root / "other"


@pytest.mark.parametrize("how", ["bit_flip", "truncated", "missing", "wrong_metadata",
                                 "garbage_manifest", "unsealed", "renamed", "another_run"])
def test_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_restored(
    tmp_path, capfd, runs, how):
  full_state, stopped, _, other = runs
  workdir = tmp_path / "run"
  shutil.copytree(stopped, workdir)
  checkpoints = workdir / "checkpoints"
  named = damage(checkpoints / "6", how, other)
  # A save killed before its rename leaves only a temporary directory: never a step to restore.
  (checkpoints / "8.orbax-checkpoint-tmp-1").mkdir()
  capfd.readouterr()

  resumed = Trainer(tiny_config(**CHANGES), workdir)
  _, resumed_final = testing.run_to_end(resumed)
  out = capfd.readouterr()
  assert f"checkpoint step 6 in {checkpoints} cannot be restored (DamagedCheckpoint: " in out.out
  assert named in out.out.split("checkpoint step 6")[1].splitlines()[0]
  assert "restoring the previous complete one" in out.out
  assert f"resumed from {checkpoints}/4" in out.out
  assert "Event loop is closed" not in out.out + out.err  # orbax never saw the damaged step
  assert (workdir / "checkpoints_unreadable" / "6").is_dir()
  for a, b in zip(jax.tree.leaves(full_state), jax.tree.leaves(resumed_final.state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_every_file_of_a_step_is_sealed_and_verified(runs):
  _, stopped, _, other = runs
  step_dir = stopped / "checkpoints" / "6"
  seal = json.loads((step_dir / checkpoint.CHECKSUM_FILE).read_text())
  assert seal["step"] == 6 and seal["run"] == checkpoint.run_identity(stopped)
  assert checkpoint.run_identity(other) != seal["run"]  # another config: another run
  sealed = seal["sha256"]
  on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()}
  assert set(sealed) == on_disk - {checkpoint.CHECKSUM_FILE}
  assert {"data/metadata", str(largest_array_chunk(step_dir).relative_to(step_dir))} <= set(sealed)
  checkpoint.verify(step_dir)  # intact: no error


def test_rerunning_a_finished_run_says_so_and_changes_nothing(runs, capsys):
  _, _, full, _ = runs
  before = tree_hash(full)
  summary = Trainer(tiny_config(**CHANGES), full).run()
  assert (
    f"the run in {full} is complete (summary.json is there); nothing to do"
    in capsys.readouterr().out
  )
  assert tree_hash(full) == before
  saved = json.loads((full / "summary.json").read_text())
  assert summary["final_eval_loss"] == saved["final_eval_loss"] is not None
  assert summary["tokens_per_s"] == saved["tokens_per_s"] > 0


def test_a_run_killed_after_its_last_checkpoint_writes_the_same_summary(tmp_path, runs):
  _, _, full, _ = runs
  shutil.copytree(full, tmp_path / "run")
  (tmp_path / "run" / "summary.json").unlink()  # killed between the last save and the summary
  summary = Trainer(tiny_config(**CHANGES), tmp_path / "run").run()
  saved = json.loads((full / "summary.json").read_text())
  assert summary["final_eval_loss"] == saved["final_eval_loss"]
  # The whole run's throughput, as the checkpoint recorded it; this start timed no step.
  assert summary["steps"] == 8 and summary["tokens_per_s"] == saved["tokens_per_s"]
  assert summary["mfu"] == saved["mfu"] and summary["null_reasons"] == {
      "this_start.tokens_per_s": "no timed step: every step of this start was in the window that "
                                 "compiles"}


def test_a_torn_metrics_line_and_a_torn_summary_are_written_again(tmp_path, runs, capsys):
  _, _, full, _ = runs
  workdir = tmp_path / "run"
  shutil.copytree(full, workdir)
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  with (workdir / "metrics.jsonl").open("a") as f:  # killed mid-append, mid-rewrite of the summary
    f.write('{"step": 9, "lo')
  (workdir / "summary.json").write_text('{"final_eval_loss": 4.')
  summary = Trainer(tiny_config(**CHANGES), workdir).run()  # not complete: resumed, no traceback
  out = capsys.readouterr().out
  assert f"{workdir / 'metrics.jsonl'}: line {len(lines) + 1} is not a logged step" in out
  assert (workdir / "metrics.jsonl").read_text().splitlines() == lines
  saved = json.loads((full / "summary.json").read_text())
  assert json.loads((workdir / "summary.json").read_text())["final_eval_loss"] == \
      summary["final_eval_loss"] == saved["final_eval_loss"]
  assert not [p.name for p in workdir.iterdir() if p.name.endswith(".tmp")]


def test_sigterm_saves_at_the_next_step_boundary_and_the_rerun_resumes_bit_identically(
    tmp_path, runs, capsys):
  full_state, _, _, _ = runs
  c = tiny_config(**{**CHANGES, "checkpoint.every": 1000})  # only the SIGTERM's save
  metrics = tmp_path / "run" / "metrics.jsonl"

  def sigterm_after_step_2():  # as SLURM or Kubernetes would, from outside the training loop
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
      time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)

  handler = signal.getsignal(signal.SIGTERM)
  threading.Thread(target=sigterm_after_step_2, daemon=True).start()
  with pytest.raises(distributed.Preempted) as stopped:
    Trainer(c, tmp_path / "run").run()
  step = stopped.value.step
  assert 2 <= step < 8
  assert "rerun the same command to resume from it" in str(stopped.value)
  assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == [str(step)]
  assert not (tmp_path / "run" / "summary.json").exists()
  assert signal.getsignal(signal.SIGTERM) == handler  # the run's handler lives as long as the run
  capsys.readouterr()
  resumed = Trainer(c, tmp_path / "run")
  _, resumed_final = testing.run_to_end(resumed)
  assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/{step}" in capsys.readouterr().out
  for a, b in zip(jax.tree.leaves(full_state), jax.tree.leaves(resumed_final.state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_init_from_starts_from_the_evaluated_parameters_of_the_latest_checkpoint(tmp_path, runs):
  full_state, _, full, _ = runs
  model_cfg, params = checkpoint.read_eval_params(full)  # no Trainer: config.json and checkpoints
  follow_up = Trainer(tiny_config(**{**CHANGES, "init_from": str(full)}), tmp_path / "next")
  assert model_cfg == follow_up.model_cfg
  evaluated = follow_up.algorithm.eval_params(full_state.params, full_state.opt_state)
  initial = follow_up.init_params()
  for leaves in (jax.tree.leaves(params), jax.tree.leaves(initial)):
    for a, b in zip(leaves, jax.tree.leaves(evaluated), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not (tmp_path / "next").exists()  # reading another run writes nothing


def test_init_from_restores_sharded_onto_the_mesh(tmp_path):
  """A 2-replica DiLoCo run with FSDP parameters (mesh 2 × 4) starts a dp run laid out over 8
  devices: the state is restored in the first run's layout, never gathered on one device, and the
  new run's parameters are its own shardings with the evaluated values."""
  first = Trainer(tiny_config(**{"algorithm": "diloco", "num_replicas": 2, "mesh.replica": 2,
                                 "outer.sync_every": 2, "sharding.layout": "fsdp", "num_steps": 2,
                                 "checkpoint.every": 2, "eval.num_batches": 1}), tmp_path / "first")
  _, first_final = testing.run_to_end(first)
  evaluated = jax.device_get(first.algorithm.eval_params(first_final.state.params,
                                                         first_final.state.opt_state))
  _, restored = checkpoint.restore_eval_params(tmp_path / "first")
  for leaf, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(first.param_shardings),
                            strict=True):
    assert leaf.sharding == expected  # the first run's layout: its mesh, embed over `data`
  embedding = max(jax.tree.leaves(restored), key=lambda x: x.size)
  assert len(embedding.sharding.device_set) == 8
  # FSDP over 4
  assert max(s.data.size for s in embedding.addressable_shards) == embedding.size // 4
  follow_up = Trainer(tiny_config(**{"sharding.layout": "fsdp",
                                     "init_from": str(tmp_path / "first")}),
                      tmp_path / "next")
  initial = follow_up.init_params()
  for leaf, sharding, expected in zip(jax.tree.leaves(initial),
                                      jax.tree.leaves(follow_up.param_shardings),
                                      jax.tree.leaves(evaluated), strict=True):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    np.testing.assert_array_equal(np.asarray(leaf), expected)
# train.py with the file size limit lowered once checkpoint 2 is sealed: every later write of more
# than 2 KiB fails with EFBIG, as a full disk fails with ENOSPC (SIGXFSZ ignored, as a shell may).
DISK_FULL_AFTER_STEP_2 = """
import pathlib, resource, runpy, signal, sys, threading, time
workdir = pathlib.Path(sys.argv[1])
def limit_after_step_2():
  while not (workdir / "checkpoints" / "2" / "lowcomm_sha256.json").exists():
    time.sleep(0.002)
  resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
threading.Thread(target=limit_after_step_2, daemon=True).start()
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_failed_save_stops_the_run_in_one_line_naming_the_intact_checkpoint(tmp_path, runs):
  full_state, _, _, _ = runs
  workdir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
  flags = {"model.size": "tiny",  # tiny_config(**CHANGES) on the command line
           "data.seq_len": 64, "data.batch_size": 8, "eval.batch_size": 8, "eval.num_batches": 4,
           "eval.every": 1000, "log_every": 1, "progress_bar": False,
           "hardware.peak_flops_per_device": 1e10, **CHANGES}
  proc = subprocess.run(
      [sys.executable, "-c", DISK_FULL_AFTER_STEP_2, str(workdir),
       str(ROOT / "experiments" / "train.py"), f"--config={CONFIGS / 'dp.py'}:tiny",
       f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in flags.items())],
      capture_output=True, text=True, timeout=240)  # no hang at exit
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stdout + proc.stderr and "Event loop" not in proc.stderr
  failure = [l for l in proc.stderr.splitlines() if l.startswith("SaveFailed: ")]
  assert len(failure) == 1, proc.stderr[-3000:]
  assert failure[0].startswith(f"SaveFailed: checkpoint step 4 could not be saved "
                               f"in {checkpoints}: EFBIG (File too large) "
                               f"writing {checkpoints}/4.orbax-checkpoint-tmp")
  assert f"checkpoint step 2 ({checkpoints / '2'}) is intact: rerun the same command" in failure[0]
  steps = [json.loads(l)["step"] for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps[-1] < 8  # stopped once the failure was known, not at the end of the run

  resumed = Trainer(tiny_config(**CHANGES), workdir)  # the disk has room again
  _, resumed_final = testing.run_to_end(resumed)
  for a, b in zip(jax.tree.leaves(full_state), jax.tree.leaves(resumed_final.state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoints_that_cannot_be_written_stop_the_run_before_its_first_step(tmp_path, runs):
  _, stopped, _, _ = runs
  workdir = tmp_path / "run"
  shutil.copytree(stopped, workdir, ignore=shutil.ignore_patterns("checkpoints"))
  (workdir / "checkpoints").write_text("not a folder\n")
  lines = (workdir / "metrics.jsonl").read_text()
  with pytest.raises(checkpoint.SaveFailed, match=re.escape(
      f"checkpoints cannot be written in {workdir / 'checkpoints'}: EEXIST (File exists)")):
    Trainer(tiny_config(**CHANGES), workdir).run()
  assert (workdir / "metrics.jsonl").read_text() == lines  # no step was trained


def test_nonfinite_raise_stops_at_the_step_that_held_it_and_finishes_the_save_in_flight(
    tmp_path, capfd):
  # lr 1e30: the update of step 2 is the first to hold inf; checkpoints after every step.
  c = tiny_config(**{"optimizer.learning_rate": 1e30, "optimizer.warmup_steps": 0, "num_steps": 6,
                     "checkpoint.every": 1})
  with pytest.raises(codecs.NonFiniteError, match="^by step 2: the parameters held NaN or inf"):
    Trainer(c, tmp_path / "run").run()
  out = capfd.readouterr()
  assert "Traceback" not in out.err and "ERROR" not in out.err  # no save abandoned
  assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["1"]  # none past it
  checkpoint.verify(tmp_path / "run" / "checkpoints" / "1")  # the save in flight was sealed
  steps = [
    json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  ]
  assert steps == [1]
