"""Algorithms as the Trainer sees them: an optax-style transform over stacked replicas.

Every algorithm runs the same step: per replica (vmapped over the `replica`
axis) a forward/backward and `tx.update`. Data parallel is one replica with
the inner optimizer as `tx`; DiLoCo and Streaming DiLoCo are M replicas with
`lowcomm_jax.streaming_diloco` as `tx`, whose phase (which fragment is sent or
applied) is read on the host for each step. NoLoCo is M replicas with
`lowcomm_jax.noloco` as `tx`, whose phase is the outer step's random grouping.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
import optax

from lowcomm_jax import codecs, optim
from lowcomm_jax.train import step as step_lib


@dataclasses.dataclass
class Algorithm:
  name: str
  tx: Any  # optax.GradientTransformation or optim.StreamingDiLoCo
  state_axes: Any  # vmap axes of the optimizer state: 0 (per replica) or a prefix tree
  num_replicas: int

  @property
  def streaming(self) -> bool:
    """The DiLoCo family: fragments, a global φ, all-reduced outer gradients."""
    return isinstance(self.tx, optim.StreamingDiLoCo)

  @property
  def gossip(self) -> bool:
    """NoLoCo: a φ_i per replica, averaged in random groups by point-to-point exchange."""
    return isinstance(self.tx, optim.NoLoCo)

  @property
  def phased(self) -> bool:
    """Whether each step's static phase is read on the host and passed to `tx.update`."""
    return self.streaming or self.gossip

  def phase_at(self, step: int):
    """The static phase of inner step `step` (1-based); None for algorithms without phases."""
    return self.tx.phase_at(step) if self.phased else None

  def init(self, params):
    """(params_R, opt_state) with a leading replica axis on what is per replica."""
    if self.phased:
      return self.tx.init_replicated(params, self.num_replicas)
    params_r = jax.tree.map(lambda x: x[None], params)
    return params_r, jax.vmap(self.tx.init)(params_r)

  def eval_params(self, params_r, opt_state):
    """Parameters to evaluate: the global φ for the DiLoCo family, the replicas' mean slow weights
    for NoLoCo (which has no global model), replica 0 otherwise."""
    if self.streaming:
      return opt_state.outer_params
    if self.gossip:
      return self.tx.eval_params(opt_state)
    return jax.tree.map(lambda x: x[0], params_r)


def make_outer_optimizer(outer_cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
  if outer_cfg.name == "nesterov":
    return optim.outer_nesterov(outer_cfg.learning_rate, outer_cfg.momentum)
  if outer_cfg.name == "sgd":
    return optax.sgd(outer_cfg.learning_rate, momentum=outer_cfg.momentum or None)
  if outer_cfg.name == "adam":
    return optax.adam(outer_cfg.learning_rate)
  raise ValueError(f"outer_optimizer.name must be nesterov, sgd or adam, got {outer_cfg.name!r}")


def make_algorithm(config: ml_collections.ConfigDict, num_replicas: int) -> Algorithm:
  inner = step_lib.make_optimizer(config.optimizer, config.num_steps)
  if config.algorithm == "dp":
    return Algorithm("dp", inner, 0, num_replicas)
  if config.algorithm == "noloco":
    n = config.noloco
    tx = optim.noloco(inner, num_replicas, sync_every=n.sync_every, group_size=n.group_size,
                      momentum=n.outer_momentum, learning_rate=n.outer_learning_rate, gamma=n.gamma,
                      seed=config.seed, num_groupings=n.num_groupings,
                      codec=None if n.codec == "none" else codecs.get_codec(n.codec, n.codec_block_size))
    return Algorithm("noloco", tx, tx.state_axes, num_replicas)
  d = config.diloco
  tx = optim.streaming_diloco(
      inner, make_outer_optimizer(config.outer_optimizer), sync_every=d.sync_every,
      fragments=d.num_fragments, overlap_steps=d.overlap_steps, merge_alpha=d.merge_alpha,
      staggered=d.staggered, fragment_pattern=d.fragment_pattern,
      non_block_fragment=d.non_block_fragment,
      codec=None if d.codec == "none" else codecs.get_codec(d.codec, d.codec_block_size, d.codec_rounding),
      error_feedback=d.error_feedback, codec_kernels=d.codec_kernels,
      overlap_anchor=d.overlap_anchor)
  return Algorithm(config.algorithm, tx, tx.state_axes, num_replicas)
