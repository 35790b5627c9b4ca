"""DiLoCo, M = 4 replicas, outer Nesterov learning rate 0.7 and momentum 0.5 (as diloco_m2.py)."""


def changes(task):
  return {"algorithm": "diloco", "num_replicas": 4, "outer.sync_every": task.sync_every,
          "outer_optimizer.learning_rate": 0.7, "outer_optimizer.momentum": 0.5}
