"""NoLoCo with a 2-stage pipeline inside, 4 replicas per stage, on 8 fake CPU devices (docs/algorithms.md §2).

  python experiments/pipeline.py --config=experiments/configs/noloco_pipeline.py --workdir=runs/nlp

Variants (`--config=experiments/configs/noloco_pipeline.py:<variant>`):
- default: NoLoCo (pairs, H = 50, α 0.5, β = γ = 0.7) across the replicas of each stage, random
  routing between the replicas of consecutive stages, the `tiny` model split 1 layer per stage,
  600 steps of 2 slots × 4 replicas × 4 sequences × 64 bytes (2048 tokens per step).
- diloco: the same grid and routing with DiLoCo (all-reduce every H = 100, outer Nesterov lr 0.7,
  momentum 0.3: the paper's DiLoCo baseline), at equal tokens.
- fixed: NoLoCo with fixed routing (replica r → replica r), to see what random routing does.
- quick: 20 steps, for a smoke run.
Measured (`python benchmarks/pipeline.py`, one seed, 2 busy CPU cores): final eval loss 2.366
(default), 2.327 (diloco), 2.345 (fixed); 40-100 s per run, 5-12 s of it compiling. quick: not
measured beyond running (eval loss 5.04 after 20 steps).
"""

from lowcomm_jax.parallel import combined


def get_config(variant: str = ""):
  c = combined.default_config()
  c.num_steps = 600
  c.eval.every = 100
  if variant in ("", "default"):
    pass
  elif variant == "diloco":
    c.algorithm = "diloco"
  elif variant == "fixed":
    c.pipeline.routing = "fixed"
  elif variant == "quick":
    c.num_steps = 20
    c.eval.every = 10
    c.noloco.sync_every = 5
    c.diloco.sync_every = 10
    c.pipeline.num_routings = 2
  else:
    raise ValueError(f"config variant must be '', 'diloco', 'fixed' or 'quick', got {variant!r}")
  return c
