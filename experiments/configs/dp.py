"""Data-parallel training of a byte-level decoder on the Python standard library's source.

  python experiments/train.py --config=experiments/configs/dp.py --workdir=runs/dp

Variants (`--config=experiments/configs/dp.py:<variant>`):
- default: the `small` model (1.35M parameters), 600 steps of 16 × 128 tokens (1.2M bytes).
  Expected on a 2-core CPU: final eval loss 1.73 nats/byte, below the bigram cross-entropy of the
  eval text estimated from the training text (2.52 nats/byte) and its unigram entropy (3.24);
  about 4 minutes.
- tiny: the `tiny` model, 200 steps, for tests and a first look (well under a minute).
"""

from lowcomm_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.default_config()
  c.algorithm = "dp"
  if variant in ("", "default"):
    config_lib.override(c, config_lib.RUN_SIZES["small"])
    c.optimizer.learning_rate = 3e-3
  elif variant == "tiny":
    config_lib.override(c, config_lib.RUN_SIZES["tiny"])
  else:
    raise ValueError(f"config variant must be '', 'default' or 'tiny', got {variant!r}")
  return c
