"""NoLoCo, M = 4: gossip in random pairs every H steps, no all-reduce, the paper's outer step
(β = 0.7, momentum 0.5, γ = 0.7; arXiv 2506.10911)."""


def changes(task):
  return {"algorithm": "noloco", "num_replicas": 4, "noloco.sync_every": task.sync_every}
