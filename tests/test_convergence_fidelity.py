"""The premise of benchmarks/convergence_long.py: through the Trainer, DiLoCo with one replica and
an outer SGD step of learning rate 1 without momentum (φ ← θ at every sync) is data-parallel
training.

Same data order (one shard of one), the same inner learning-rate schedule across outer steps, and φ
evaluated after the outer step of the last step: any difference in the benchmark between DiLoCo M=1
and data-parallel then comes from the outer optimizer's learning rate and momentum alone.
"""

import json

import jax
import numpy as np

from lowcomm_jax import config as config_lib, testing
from lowcomm_jax.train import Trainer


def _config(**changes):
  c = config_lib.default_config()
  config_lib.override(c, {
      "model.size": "tiny", "num_steps": 12, "data.seq_len": 64, "data.batch_size": 8,
      "optimizer.warmup_steps": 4, "eval.batch_size": 8, "eval.num_batches": 4, "eval.every": 4,
      "checkpoint.every": 1000, "log_every": 4, "progress_bar": False,
      "hardware.peak_flops_per_device": 1e10, "mesh.data": 1, **changes})
  return c


def test_diloco_one_replica_outer_sgd_lr1_is_data_parallel(tmp_path):
  dp = Trainer(_config(algorithm="dp"), tmp_path / "dp")
  dp_summary, dp_final = testing.run_to_end(dp)
  diloco = Trainer(_config(**{"algorithm": "diloco", "num_replicas": 1, "outer.sync_every": 4,
                              "outer_optimizer.name": "sgd", "outer_optimizer.learning_rate": 1.0,
                              "outer_optimizer.momentum": 0.0}), tmp_path / "diloco")
  diloco_summary, diloco_final = testing.run_to_end(diloco)
  curve = lambda wd: [r["eval_loss"] for r in map(json.loads,
                                                  (wd / "metrics.jsonl").read_text().splitlines())
                      if "eval_loss" in r]
  assert len(curve(tmp_path / "dp")) == 3  # after steps 4, 8, 12: each right after an outer step
  # The two differ only by φ − 1·(φ − θ)'s 2 roundings per step (12 steps), relative to each
  # compared value's scale; the eval is one program on parameters that close.
  curve_bound = testing.trajectory_error_bound(curve(tmp_path / "dp"), 12, 2)
  testing.assert_within(curve(tmp_path / "diloco"), curve(tmp_path / "dp"), curve_bound,
                        "eval curve")
  testing.assert_within(diloco_summary["final_eval_loss"], dp_summary["final_eval_loss"],
                        curve_bound,
                        "final eval loss")
  phi = diloco_final.state.opt_state.outer_params
  dp_params = jax.tree.map(lambda b: np.asarray(b)[0], dp_final.state.params)
  testing.assert_trees_within(phi, dp_params, lambda b: testing.trajectory_error_bound(b, 12, 2),
                              "φ")
