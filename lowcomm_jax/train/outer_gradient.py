"""A real DiLoCo outer gradient from the Trainer, for measuring codecs on it (`codecs.analysis`).

Δ = θ_start − θ_end of replica 0 after H inner steps (docs/algorithms.md §1.1's sign): the run has
H + 1 steps with sync_every = H + 1 and stops after step H (`stop_at_step`), one step before its
first sync, so φ is still θ_start and Δ = φ − θ_0 is exactly what replica 0 would send.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import jax
import ml_collections

from lowcomm_jax import config as config_lib
from lowcomm_jax.train import hooks
from lowcomm_jax.train.trainer import Trainer


def outer_gradient_config(model_size: str = "small", num_replicas: int = 2, inner_steps: int = 50,
                          seed: int = 0) -> ml_collections.ConfigDict:
  """DiLoCo on the stdlib corpus (8 sequences of 128 bytes per replica and step), stopped after
  `inner_steps` inner AdamW steps, just before its first sync."""
  c = config_lib.default_config()
  return config_lib.override(c, {
      "model.size": model_size, "algorithm": "diloco", "num_replicas": num_replicas, "seed": seed,
      "num_steps": inner_steps + 1, "outer.sync_every": inner_steps + 1,
      "stop_at_step": inner_steps,
      "data.batch_size": 8, "data.seq_len": 128, "optimizer.warmup_steps": min(30, inner_steps),
      "progress_bar": False, "log_every": inner_steps, "eval.every": 10 * inner_steps,
      "checkpoint.every": 10 * inner_steps, "hardware.peak_flops_per_device": 1e10})


def diloco_outer_gradient(model_size: str = "small", num_replicas: int = 2, inner_steps: int = 50,
                          seed: int = 0) -> tuple[dict, dict]:
  """(Δ, info): replica 0's outer gradient as a tree of host arrays shaped like the parameters, and
  the run's model, M, H and the replicas' mean training loss at step H. The run's directory is
  temporary."""
  c = outer_gradient_config(model_size, num_replicas, inner_steps, seed)
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer(c, workdir)
    final = hooks.FinalState()
    trainer.run(hooks=[final])
    state = final.state
    delta = jax.device_get(jax.tree.map(lambda phi, theta: phi - theta[0],
                                        state.opt_state.outer_params, state.params))
    last = json.loads((pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()[-1])
  return delta, {"model": model_size, "replicas": num_replicas, "inner_steps": inner_steps,
                 "train_loss": last["loss"]}
