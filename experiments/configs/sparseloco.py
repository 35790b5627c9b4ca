"""SparseLoCo: Streaming DiLoCo's schedule with top-k, 2-bit outer gradients and error feedback.

  python experiments/train.py --config=experiments/configs/sparseloco.py --workdir=runs/sparseloco

Every H steps each replica adds its outer gradient Δ to an error buffer decayed by β, sends only the
top_k largest entries of every chunk of chunk_size values, each as a 2-bit code with per-chunk
levels (positions bit-packed), and keeps the rest in the buffer. The payloads are all-gathered and
averaged by a scatter-add; the outer step is SGD with no momentum (the buffer is the momentum).
docs/sparseloco.md has the method, the wire format and its bytes.

Variants (`--config=experiments/configs/sparseloco.py:<variant>`):
- default / paper: the paper's compression (chunks of 4096, k = 64: 1.56 %, 2 bits, β = 0.95,
  η = 1) on the `small` model (6 layers), M = 2, H = 30, one fragment, 600 steps of 16 × 128
  tokens per replica.
- streaming: the same with Streaming DiLoCo's fragments: P = 3 (+1 non-block), τ = 1, α = 0.5.
- tiny: the `tiny` model (2 layers), M = 2, H = 10, chunks of 256 with k = 8, 200 steps: eval loss
  3.26 in 47 s on a loaded 2-core CPU (0.5 CPU-minutes), 52,780 bytes sent per worker.
"""

from lowcomm_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.default_config()
  c.algorithm = "sparseloco"
  c.num_replicas = 2
  s, o = c.sparseloco, c.outer
  if variant in ("", "default", "paper", "streaming"):
    config_lib.override(c, config_lib.RUN_SIZES["small"])
    o.sync_every, s.chunk_size, s.top_k, s.bits = 30, 4096, 64, 2
    s.feedback_decay, s.outer_learning_rate = 0.95, 1.0
    if variant == "streaming":
      o.sync_every, o.num_fragments, o.overlap_steps, o.merge_alpha = 32, 3, 1, 0.5
  elif variant == "tiny":
    config_lib.override(c, config_lib.RUN_SIZES["tiny"])
    o.sync_every, s.chunk_size, s.top_k = 10, 256, 8
  else:
    raise ValueError(f"config variant must be '', 'default', 'paper', 'streaming' or 'tiny', "
                     f"got {variant!r}")
  return c
