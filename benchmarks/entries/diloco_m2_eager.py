"""DiLoCo, M = 2, with eager outer updates (arXiv 2502.12996): each outer all-reduce overlaps the
whole next outer phase (τ = H), every worker stepping at once with its own fresh Δ in place of its
share of the mean; outer learning rate 0.7 and momentum 0.5, as diloco_m2."""


def changes(task):
  return {"algorithm": "diloco", "num_replicas": 2, "outer.sync_every": task.sync_every,
          "outer.overlap_steps": task.sync_every, "outer.eager": True,
          "outer_optimizer.learning_rate": 0.7, "outer_optimizer.momentum": 0.5}
