"""DiLoCo, M = 2 replicas, outer Nesterov learning rate 0.7 and momentum 0.5 (the tuned setting;
diloco_m2_paper.py has the papers' momentum 0.9)."""


def changes(task):
  return {"algorithm": "diloco", "num_replicas": 2, "outer.sync_every": task.sync_every,
          "outer_optimizer.learning_rate": 0.7, "outer_optimizer.momentum": 0.5}
