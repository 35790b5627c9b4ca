"""SkipPipe path training (docs/algorithms.md §3.4): micro-batches skip and reorder pipeline stages.

  python experiments/train.py --config=experiments/configs/skippipe.py --workdir=runs/skip
  python experiments/train.py --config=experiments/configs/skippipe.py:full --workdir=runs/full

The `small` model cut into 6 stages of 1 layer. The SkipPipe scheduler plans the per-micro-batch
paths on the 12-region preset (20 nodes, stages [5,3,3,3,3,3], 4 of 6 stages per path = 33%
skipped; placement seed 0) when the run starts: 10 micro-batches of 4 sequences × 128 bytes per
step, each along its own path; the gradients are summed over micro-batches and AdamW (b2 0.999, no
weight decay, clip 1.0, lr 1e-3 with 20 warm-up steps and cosine decay to 0.1×) steps, as in the
reference. A run like any other: checkpoints, resume, metrics.jsonl, summary.json.

Variants (`--config=experiments/configs/skippipe.py:<variant>`):
- default / skip: the scheduler's paths, 200 steps.
- full: every micro-batch through all 6 stages in order (the full pipeline), same data and init.
- quick / quick_full: 12 steps of 10 micro-batches of 2 sequences, for a smoke run.
`python experiments/skippipe.py --workdir=DIR` runs skip and full and the half-model test; measured
(200 steps, 2 CPU cores, `benchmarks/results/skippipe_training.json`): see docs/skippipe.md.
"""

from lowcomm_jax import config as config_lib

NUM_STAGES, NUM_MICROBATCHES = 6, 10  # the 12-region preset: 5 data nodes × 2 micro-batches each


def full_paths(num_stages: int = NUM_STAGES, num_microbatches: int = NUM_MICROBATCHES) -> str:
  """Every micro-batch through every stage in order, as `skippipe.paths`."""
  return ",".join(["-".join(str(s) for s in range(num_stages))] * num_microbatches)


def get_config(variant: str = ""):
  c = config_lib.default_config()
  config_lib.override(c, {
      "gradients": "skippipe", "model.size": "small", "num_steps": 200,
      "pipeline.num_stages": NUM_STAGES, "pipeline.layers_per_stage": 1,
      "skippipe.topology": "gcp_12_regions", "skippipe.path_length": 4,
      "skippipe.microbatches_per_data_node": 2, "skippipe.placement_seed": 0,
      "data.seq_len": 128, "data.batch_size": NUM_MICROBATCHES * 4,
      "optimizer.name": "adamw", "optimizer.learning_rate": 1e-3, "optimizer.warmup_steps": 20,
      "optimizer.b2": 0.999, "optimizer.weight_decay": 0.0, "optimizer.grad_clip": 1.0,
      "eval.every": 20, "eval.batch_size": 16, "eval.num_batches": 8, "checkpoint.every": 100,
  })
  if variant.startswith("quick"):
    config_lib.override(c,
                        {"num_steps": 12, "optimizer.warmup_steps": 1,
                         "data.batch_size": NUM_MICROBATCHES * 2,
                            "eval.every": 6, "eval.num_batches": 2, "checkpoint.every": 6})
  if variant in ("full", "quick_full"):
    c.skippipe.paths = full_paths()
  elif variant not in ("", "default", "skip", "quick"):
    raise ValueError("config variant must be '', 'default', 'skip', 'full', 'quick' or "
                     f"'quick_full', got {variant!r}")
  return c
