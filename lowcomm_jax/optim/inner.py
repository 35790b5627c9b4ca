"""The inner optimizer a config names (`config.optimizer`), and the state a training loop carries.

  adamw, adam  optax's, with β1, β2 and (adamw) decoupled weight decay
  sgd          optax's, with heavy-ball momentum when `momentum` > 0
  muon         optax.contrib.muon as MuLoCo uses it (docs/algorithms.md): the layer blocks' weight
               matrices step by Muon (momentum β1, Nesterov, the update orthogonalized by
               Newton–Schulz, each layer of a stacked [L, ...] weight and each attention weight as
               one d_model × (heads · head_dim) matrix); the embeddings, the output head and the
               norm scales step by AdamW (β1, β2), as Muon is not meant for them. Both parts share
               the learning rate: Muon's update is scaled to AdamW's RMS (0.2 · sqrt(max(fan_in,
               fan_out))), and `weight_decay` decays both.

Every optimizer follows the same schedule (linear warm-up, then cosine decay) and is clipped to the
global norm `grad_clip` first.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax
from optax import contrib

from lowcomm_jax.models import llama

OPTIMIZERS = ("adamw", "adam", "sgd", "muon")
# Muon's update RMS matched to AdamW's (Liu et al. 2025), so that one learning rate serves both.
MUON_CONSISTENT_RMS = 0.2
# (reduction axes, output axes) of each block matrix, counted from the end: leading axes (the
# stacked layers) are batch axes, each layer's matrix orthogonalized on its own.
_MUON_AXES = {
    "attn/wq": (-3, (-2, -1)), "attn/wk": (-3, (-2, -1)), "attn/wv": (-3, (-2, -1)),
    "attn/wo": ((-3, -2), -1),
    "mlp/w_gate": (-2, -1), "mlp/w_up": (-2, -1), "mlp/w_down": (-2, -1),
}


class TrainState(NamedTuple):
  """A training loop's state; pure pytrees so optax, jit and orbax all see plain arrays."""

  params: Any  # pure dict of float32 arrays
  opt_state: Any
  step: jax.Array  # int32[]


def learning_rate_schedule(opt_cfg, num_steps: int) -> optax.Schedule:
  """Linear warm-up to the peak, then cosine decay to min_lr_ratio · peak at num_steps."""
  peak = opt_cfg.learning_rate
  warmup = min(opt_cfg.warmup_steps, max(num_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else peak, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(num_steps, warmup + 1), end_value=peak * opt_cfg.min_lr_ratio)


def muon_dimension_numbers(params):
  """Muon's `MuonDimensionNumbers` for the layer blocks' weight matrices of a decoder's parameter
  tree, None (AdamW) for every other leaf."""

  def spec(key_path, _):
    name = llama.path_name(key_path)
    axes = next((a for suffix, a in _MUON_AXES.items()
                 if name.startswith("blocks/") and name.endswith(suffix)), None)
    return None if axes is None else contrib.MuonDimensionNumbers(*axes)

  return jax.tree_util.tree_map_with_path(spec, params)


def make_optimizer(opt_cfg, num_steps: int) -> optax.GradientTransformation:
  """The inner optimizer named by `config.optimizer`, with clipping."""
  lr = learning_rate_schedule(opt_cfg, num_steps)
  if opt_cfg.name == "adamw":
    tx = optax.adamw(lr, b1=opt_cfg.b1, b2=opt_cfg.b2, weight_decay=opt_cfg.weight_decay)
  elif opt_cfg.name == "adam":
    tx = optax.adam(lr, b1=opt_cfg.b1, b2=opt_cfg.b2)
  elif opt_cfg.name == "muon":
    tx = contrib.muon(lr, beta=opt_cfg.b1, weight_decay=opt_cfg.weight_decay, adam_b1=opt_cfg.b1,
                      adam_b2=opt_cfg.b2, adam_weight_decay=opt_cfg.weight_decay,
                      muon_weight_dimension_numbers=muon_dimension_numbers,
                      consistent_rms=MUON_CONSISTENT_RMS)
  else:
    tx = optax.sgd(lr, momentum=opt_cfg.momentum or None)
  if opt_cfg.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(opt_cfg.grad_clip), tx)
  return tx
