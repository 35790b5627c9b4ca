"""NoLoCo with a 2-stage pipeline inside, 4 replicas per stage, on 8 fake CPU devices
(docs/algorithms.md §2).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python experiments/train.py --config=experiments/configs/noloco_pipeline.py --workdir=runs/nlp

(XLA_FLAGS gives a CPU host the 8 devices of the grid; GPU and TPU hosts use their own.)
A run like any other: checkpoints, resume (bit-identical), metrics.jsonl, summary.json with the
bytes each device sends (the pipeline's activations and gradients, NoLoCo's pairwise exchange).

Variants (`--config=experiments/configs/noloco_pipeline.py:<variant>`):
- default: NoLoCo (pairs, H = 50, α 0.5, β = γ = 0.7) across the replicas of each stage, random
  routing between the replicas of consecutive stages, the `tiny` model split 1 layer per stage,
  600 steps of 2 slots × 4 replicas × 4 sequences × 64 bytes (2048 tokens per step); inner Adam
  (b2 0.95, no weight decay, no clipping), as in NoLoCo's code.
- diloco: the same grid and routing with DiLoCo (all-reduce every H = 100, outer Nesterov lr 0.7,
  momentum 0.3: the paper's DiLoCo baseline), at equal tokens.
- fixed: NoLoCo with fixed routing (replica r → replica r), to see what random routing does.
- quick: 20 steps, for a smoke run.
Measured with the former pipeline loop (`python benchmarks/pipeline.py`, one seed, 2 busy CPU
cores; its training steps are bit-identical to this config's): final eval loss, the mean over
replicas of each replica's own model, 2.366 (default), 2.327 (diloco), 2.345 (fixed); 40-100 s per
run. This config reports that mean as the mean of summary.json's final_eval_loss_replicas (NoLoCo)
and φ's loss as final_eval_loss.
"""

from lowcomm_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.default_config()
  config_lib.override(c, {
      "algorithm": "noloco", "gradients": "pipeline", "num_replicas": 4, "num_steps": 600,
      "mesh.replica": 4, "mesh.stage": 2, "mesh.data": 1,
      "pipeline.num_stages": 2, "pipeline.layers_per_stage": 1, "pipeline.slots_per_step": 2,
      "pipeline.num_routings": 4, "data.seq_len": 64, "data.batch_size": 8,
      "optimizer.name": "adam", "optimizer.learning_rate": 3e-3, "optimizer.warmup_steps": 20,
      "optimizer.b2": 0.95, "optimizer.grad_clip": 0.0,
      "noloco.sync_every": 50, "noloco.outer_momentum": 0.5, "noloco.outer_learning_rate": 0.7,
      "noloco.gamma": 0.7, "noloco.num_groupings": 4,
      "outer.sync_every": 100, "outer_optimizer.learning_rate": 0.7,
      "outer_optimizer.momentum": 0.3,
      "eval.every": 100, "eval.batch_size": 8, "eval.num_batches": 4, "checkpoint.every": 100,
  })
  if variant in ("", "default"):
    pass
  elif variant == "diloco":
    c.algorithm = "diloco"
  elif variant == "fixed":
    c.pipeline.routing = "fixed"
  elif variant == "quick":
    config_lib.override(c, {"num_steps": 20, "eval.every": 10, "checkpoint.every": 10,
                            "noloco.sync_every": 5, "outer.sync_every": 10,
                            "pipeline.num_routings": 2})
  else:
    raise ValueError(f"config variant must be '', 'diloco', 'fixed' or 'quick', got {variant!r}")
  return c
