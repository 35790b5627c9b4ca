"""DiLoCo with one replica (M = 1): the outer Nesterov step alone, against data-parallel.

Outer momentum 0.5: at the small scales' few outer steps the papers' 0.9 leaves DiLoCo above
data-parallel (benchmarks/results/README.md, convergence over 3,000 steps); diloco_m1_paper.py
keeps 0.9.
"""


def changes(task):
  return {"algorithm": "diloco", "num_replicas": 1, "outer.sync_every": task.sync_every,
          "outer_optimizer.learning_rate": 0.7, "outer_optimizer.momentum": 0.5}
