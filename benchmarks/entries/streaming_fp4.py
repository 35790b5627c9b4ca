"""Streaming DiLoCo, M = 2: two strided fragments (embeddings and head folded into the first),
outer gradients in 4 bits (e3m0), each all-reduce overlapped with τ = 1 inner step, merge α = 0.5,
outer learning rate 0.4 (the paper's settings, arXiv 2501.18512)."""


def changes(task):
  return {"algorithm": "streaming_diloco", "num_replicas": 2, "outer.sync_every": task.sync_every,
          "outer.num_fragments": 2, "outer.fragment_pattern": "strided",
          "outer.non_block_fragment": "fold", "outer.overlap_steps": 1, "outer.merge_alpha": 0.5,
          "outer.codec": "e3m0", "outer_optimizer.learning_rate": 0.4}
