"""SparseLoCo, M = 2: top-64 of each 4,096-value chunk at 2 bits, error feedback β = 0.95, outer
SGD step η = 2 (η = M: the scatter-add mean divides a value one of M workers sent by M; the best
setting of the convergence runs). sparseloco_paper.py keeps the paper's η = 1."""


def changes(task):
  return {"algorithm": "sparseloco", "num_replicas": 2, "outer.sync_every": task.sync_every,
          "sparseloco.top_k": 64, "sparseloco.feedback_decay": 0.95,
          "sparseloco.outer_learning_rate": 2.0}
