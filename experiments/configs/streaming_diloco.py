"""Streaming DiLoCo: fragments synced on a staggered schedule, overlapped τ steps, merged with α.

  python experiments/train.py --config=experiments/configs/streaming_diloco.py --workdir=runs/sdl

The model's stacked blocks are split into P strided fragments (blocks p, p+P, ...) plus one fragment
of the non-block parameters (embedding, final norm, head). Fragment p syncs every H steps at offset
(p+1)·H/(P+1); its all-reduce is issued from the parameters entering the step after, overlaps τ
inner steps, and is merged as θ ← α·θ_local + (1−α)·θ_global. Peak bytes per sync are about 1/(P+1)
of DiLoCo's; total bytes are the same. Other fragments as data, whole parameters by a regex table
over their paths (first full match wins):
`--config.outer.fragment_rules="blocks/attn/.*:0,blocks/.*:1,.*:2"` (with num_fragments left at 1;
H must be divisible by the number of fragments).

Variants (`--config=experiments/configs/streaming_diloco.py:<variant>`):
- default / small: the `small` model (6 layers), M = 2, H = 60, P = 3 (+1 non-block fragment),
  τ = 1, α = 0.5, 600 steps of 16 × 128 tokens per replica; peak bytes per sync 0.32 of DiLoCo's
  (the largest fragment: 2 of the 6 blocks), 53.5 MB sent per worker in all. Expected: final eval
  loss 1.71 nats/byte; 8.5 minutes on a heavily loaded 2-core CPU (4.8 CPU-minutes).
- fp4: the same with outer gradients sent as e3m0 (4-bit float, absmax scale per 1024 values):
  7.9× fewer bits (6.7 MB per worker in all). Expected: final eval loss 1.69 nats/byte; 26 minutes
  on a heavily loaded 2-core CPU (5.1 CPU-minutes).
- tiny: the `tiny` model (2 layers), M = 2, H = 12, P = 2 (+1), τ = 1, α = 0.5, 200 steps: final
  eval loss 2.67 in about 20 s.
"""

from lowcomm_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.default_config()
  c.algorithm = "streaming_diloco"
  c.num_replicas = 2
  c.outer.fragment_pattern = "strided"
  c.outer.overlap_steps = 1
  c.outer.merge_alpha = 0.5
  if variant in ("", "default", "small", "fp4"):
    config_lib.override(c, config_lib.RUN_SIZES["small"])
    c.outer.sync_every = 60
    c.outer.num_fragments = 3
    if variant == "fp4":
      c.outer.codec = "e3m0"
  elif variant == "tiny":
    config_lib.override(c, config_lib.RUN_SIZES["tiny"])
    c.outer.sync_every = 12
    c.outer.num_fragments = 2
  else:
    raise ValueError(f"config variant must be '', 'default', 'small', 'fp4' or 'tiny', "
                     f"got {variant!r}")
  return c
