"""The data-parallel Trainer: learning on real text, resume, meshes and layouts, bad input."""

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from lowcomm_jax import testing
from lowcomm_jax.data import pipeline, stats
from lowcomm_jax.testing import read_metrics, tiny_config, tree_hash  # pylint: disable=unused-import
from lowcomm_jax.train import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_run_learns_real_text_below_the_unigram_entropy(tmp_path):
  c = tiny_config(num_steps=300, log_every=50,
                  **{"eval.num_batches": 16, "optimizer.learning_rate": 1e-2,
                                                   "data.batch_size": 16})
  summary = Trainer(c, tmp_path).run()
  splits = pipeline.load_splits("stdlib", c.data.eval_permille)
  unigram = stats.unigram_entropy(splits.eval)  # about 3.24 nats per byte
  assert summary["final_eval_loss"] < unigram - 0.3
  assert summary["steps"] == 300 and summary["tokens"] == 300 * 16 * 64
  on_disk = json.loads((tmp_path / "summary.json").read_text())
  assert on_disk["final_eval_loss"] == summary["final_eval_loss"]
  assert (tmp_path / "tensorboard").is_dir() and (tmp_path / "checkpoints" / "300").is_dir()


@pytest.fixture(scope="module")
def one_device_metrics(tmp_path_factory):
  """The metrics of the 5-step run on one device that every layout's 8-device run is compared to."""
  workdir = tmp_path_factory.mktemp("one_device") / "run"
  c1 = tiny_config(num_steps=5, **{"sharding.layout": "replicated", "mesh.data": 1})
  Trainer(c1, workdir, devices=jax.devices()[:1]).run()
  return read_metrics(workdir)


@pytest.mark.parametrize("layout,mesh", [("replicated", {"data": 8}), ("fsdp", {"data": 8}),
                                          ("tensor", {"data": 4, "tensor": 2})])
def test_eight_devices_match_one_device_and_shardings_follow_the_rules(tmp_path, layout, mesh,
                                                                        one_device_metrics):
  assert len(jax.devices()) >= 8, "conftest sets 8 fake CPU devices"
  c8 = tiny_config(num_steps=5, **{"sharding.layout": layout})
  for axis, size in mesh.items():
    c8.mesh[axis] = size
  many = Trainer(c8, tmp_path / "many")
  many.run()
  # 8 devices sum in other orders than one: each step's loss within the chain-of-sums bound.
  chain = testing.tiny_chain_of_sums(64, 8 * 64)
  for m, o in zip(read_metrics(tmp_path / "many"), one_device_metrics, strict=True):
    testing.assert_within(m["loss"], o["loss"],
                          testing.trajectory_error_bound(o["loss"], o["step"], chain),
                          f"loss at step {o['step']}")
  # The compiled step's parameter shardings are the ones the rules ask for.
  compiled, _ = many.program(None, many.init_state())
  out_params = compiled.output_shardings[0].params  # [replica, layers, ...]
  expected = {"replicated": (None, None, None, None), "fsdp": (None, "data", None, None),
              "tensor": (None, None, "tensor", None)}[layout]
  wq = out_params["blocks"]["attn"]["wq"]
  assert wq.is_equivalent_to(jax.sharding.NamedSharding(many.mesh, jax.sharding.PartitionSpec(
      "replica", *expected)), 5)
  w_up = tuple(out_params["blocks"]["mlp"]["w_up"].spec)[1:]
  assert w_up + (None,) * (3 - len(w_up)) == {"replicated": (None, None, None),
                                              "fsdp": (None, "data", None),
                                              "tensor": (None, None, "tensor")}[layout]


def test_mesh_larger_than_devices_is_refused_before_anything_is_written(tmp_path):
  c = tiny_config(**{"mesh.data": 16})
  with pytest.raises(ValueError, match=r"mesh .* needs 16 devices but 8 are available"):
    Trainer(c, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_batch_not_divisible_over_data_axis(tmp_path):
  c = tiny_config(**{"mesh.data": 8, "data.batch_size": 12})
  with pytest.raises(ValueError,
                     match=r"data.batch_size=12 is not divisible by the mesh's data axis \(8\)"):
    Trainer(c, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_unknown_and_bad_values_are_named(tmp_path):
  c = tiny_config()
  c.unlock()
  c.model.sise = "tiny"
  with pytest.raises(ValueError, match=r"unknown config keys \['model.sise'\]"):
    Trainer(c, tmp_path)
  with pytest.raises(ValueError, match=r"model.size must be one of"):
    Trainer(tiny_config(**{"model.size": "huge"}), tmp_path)
  with pytest.raises(ValueError, match=r"sharding.layout must be one of"):
    Trainer(tiny_config(**{"sharding.layout": "zero"}), tmp_path)


def test_workdir_of_another_config_is_refused_and_left_as_it_was(tmp_path):
  Trainer(tiny_config(num_steps=4, **{"checkpoint.every": 2}), tmp_path).run()
  before = tree_hash(tmp_path)
  with pytest.raises(ValueError, match=r"holds a run of another config \(optimizer.learning_rate"):
    Trainer(tiny_config(num_steps=4, **{"optimizer.learning_rate": 0.5}), tmp_path)
  assert tree_hash(tmp_path) == before


def test_binary_rejects_an_unknown_config_key_before_compute(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "train.py"),
       f"--config={ROOT / 'experiments' / 'configs' / 'dp.py'}:tiny", f"--workdir={tmp_path / 'w'}",
       "--config.optimizer.learnin_rate=0.1"], capture_output=True, text=True, env=env, timeout=120)
  assert proc.returncode != 0
  assert "learnin_rate" in proc.stderr
  assert not (tmp_path / "w").exists()



def test_a_throughput_window_after_an_evaluation_holds_only_the_steps_it_timed():
  """eval.every = 30 between steps logged every 20: steps 21-30 ran before the evaluation, outside
  the window that the restart after it opens, so the window logged at 40 holds steps 31-40 only."""
  from lowcomm_jax.train import metrics, mfu  # pylint: disable=g-import-not-at-top
  t = metrics.Throughput(tokens_per_step=100, flops_per_token=6.0, peak=mfu.RunPeak("wall", 1e9),
                         first_step=0)
  for _ in range(20):
    t.count_step()
  assert t.take_window_steps() == 20  # logged at step 20
  t.window(20, 20, fetched_at=time.perf_counter())  # the run's first window (it compiles): untimed
  for _ in range(10):  # steps 21-30, then the evaluation
    t.count_step()
  t.restart()
  for _ in range(10):  # steps 31-40
    t.count_step()
  steps = t.take_window_steps()
  assert steps == 10
  values = t.window(40, steps, fetched_at=t._wall + 2.0)  # pylint: disable=protected-access
  assert values["tokens_per_s"] == 10 * 100 / 2.0
  assert t.steps == 10 and t.tokens_per_s == 10 * 100 / 2.0


def test_metrics_one_step_behind_fetch_after_the_next_dispatch():
  from lowcomm_jax.train import metrics  # pylint: disable=g-import-not-at-top
  fetched, ticks = [], iter([10.0, 20.0])
  behind = metrics.OneStepBehind(lambda tree: fetched.append(dict(tree)) or tree,
                                 clock=lambda: next(ticks))
  assert behind.ready() is None  # nothing held: no fetch at all
  behind.hold(5, {"loss": np.asarray([1.0, 3.0])}, {"tokens_per_s": 7.0})
  assert not fetched  # holding does not touch the device values
  with pytest.raises(RuntimeError, match="step 5's metrics are still held"):
    behind.hold(6, {"loss": np.asarray(0.0)})
  assert behind.ready() == (5, {"loss": 2.0, "tokens_per_s": 7.0}, 10.0)
  assert len(fetched) == 1 and behind.ready() is None


def _tensorboard_events(workdir) -> list[list]:
  """Each events file's (step, scalar tags, purge step or None) in order, read from the TFRecord
  framing (length, its CRC, the Event, its CRC)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  files = []
  for path in sorted((pathlib.Path(workdir) / "tensorboard").iterdir()):
    data, offset, events = path.read_bytes(), 0, []
    while offset < len(data):
      length = int.from_bytes(data[offset:offset + 8], "little")
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      purge = event.step if event.session_log.status == event_pb2.SessionLog.START else None
      events.append((event.step, {v.tag for v in event.summary.value}, purge))
    files.append(events)
  return files


def test_a_resumed_run_reports_the_whole_run_and_keeps_the_resume_steps_scalars(tmp_path):
  """Stopped after step 3 (its checkpoint), resumed to step 4: summary.json's wall_time_s and
  tokens_per_s are the whole run's (the earlier start's figures as its checkpoint recorded them,
  plus this start's), this start's own beside them (`this_start`); TensorBoard keeps step 3's
  scalars, purging from step 4 on, which the resumed start logs."""
  changes = {"num_steps": 4, "checkpoint.every": 2, "log_every": 1}
  Trainer(tiny_config(stop_at_step=3, **changes), tmp_path).run()
  timing = json.loads((tmp_path / "checkpoints" / "3" / "data" / "metadata").read_text())["timing"]
  summary = Trainer(tiny_config(**changes), tmp_path).run()
  this = summary["this_start"]
  assert this["first_step"] == 4
  assert summary["wall_time_s"] == timing["wall_time_s"] + this["wall_time_s"]
  # Steps 2 and 3 were timed (step 1's window compiles); step 4, this start's first, compiles.
  earlier, tokens_per_step = timing["throughput"], 8 * 64
  assert earlier["steps"] == 2 and this["tokens_per_s"] is None
  assert summary["tokens_per_s"] == earlier["steps"] * tokens_per_step / earlier["seconds"]
  on_disk = json.loads((tmp_path / "summary.json").read_text())
  assert on_disk["tokens_per_s"] == summary["tokens_per_s"]
  assert on_disk["this_start"]["first_step"] == 4
  assert on_disk["null_reasons"] == {"this_start.tokens_per_s": "no timed step: every step of this "
                                     "start was in the window that compiles"}
  first, resumed = _tensorboard_events(tmp_path)
  assert {step for step, tags, _ in first if "loss" in tags} == {1, 2, 3}
  assert [purge for _, _, purge in resumed if purge is not None] == [4]
  assert {step for step, tags, _ in resumed if "loss" in tags} == {4}
