"""DiLoCo, M = 2, the papers' outer Nesterov: learning rate 0.7, momentum 0.9."""


def changes(task):
  return {"algorithm": "diloco", "num_replicas": 2, "outer.sync_every": task.sync_every,
          "outer_optimizer.learning_rate": 0.7, "outer_optimizer.momentum": 0.9}
