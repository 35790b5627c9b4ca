"""SparseLoCo, M = 2, the paper's settings (arXiv 2508.15706): top-64 of 4,096 at 2 bits,
β = 0.95, η = 1."""


def changes(task):
  return {"algorithm": "sparseloco", "num_replicas": 2, "outer.sync_every": task.sync_every,
          "sparseloco.top_k": 64, "sparseloco.feedback_decay": 0.95,
          "sparseloco.outer_learning_rate": 1.0}
