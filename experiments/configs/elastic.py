"""Elastic DiLoCo on Ray: N learners train through failures, stragglers, leaves and joins.

  python experiments/elastic.py --config=experiments/configs/elastic.py:tiny --workdir=runs/elastic
  python experiments/elastic.py --config=experiments/configs/elastic.py:tiny --workdir=runs/e2 \\
      --config.elastic.faults=kill:learner=1:step=35,slow:learner=2:step=1:factor=3

Each learner is one DiLoCo replica (its own devices, shard i of N of the data); the syncer holds φ
and the outer Nesterov state and closes a round once `elastic.min_quorum` learners sent Δ and
`elastic.grace_s` passed (docs/elastic.md).

Variants (`--config=experiments/configs/elastic.py:<variant>`):
- tiny: the `tiny` model, 4 learners, quorum 3, grace 1 s, H = 10, 200 steps of 16 × 64 tokens
  per learner, on one CPU device each: eval loss 3.09, 77 s on a loaded 2-core CPU, no faults.
- small: the `small` model, 4 learners, quorum 3, H = 30, 600 steps of 8 × 128 tokens.
- streaming: tiny with Streaming DiLoCo's fragments (P = 2, τ = 2, α = 0.5).
- gpu: the `small` model with one learner per GPU (`elastic.learner_gpus=1`), on a Ray cluster
  (`elastic.address=auto`, started with `ray start` on each host).
"""

from lowcomm_jax import config as config_lib


def get_config(variant: str = "tiny"):
  c = config_lib.default_config()
  c.algorithm = "diloco"
  c.mesh.data = 1
  e = c.elastic
  e.num_learners, e.min_quorum, e.grace_s = 4, 3, 1.0
  if variant in ("", "tiny", "streaming"):
    config_lib.override(c, config_lib.RUN_SIZES["tiny"])
    c.outer.sync_every = 10
    c.eval.num_batches = 4
    if variant == "streaming":
      c.algorithm = "streaming_diloco"
      c.outer.num_fragments, c.outer.overlap_steps, c.outer.merge_alpha = 2, 2, 0.5
  elif variant in ("small", "gpu"):
    config_lib.override(c, config_lib.RUN_SIZES["small"])
    c.data.batch_size = 8
    c.outer.sync_every = 30
    if variant == "gpu":
      c.mesh.data = -1
      e.address, e.learner_gpus = "auto", 1.0
  else:
    raise ValueError("config variant must be '', 'tiny', 'streaming', 'small' or 'gpu', "
                     f"got {variant!r}")
  c.num_replicas = e.num_learners  # the SPMD run this equals when nothing fails
  return c
