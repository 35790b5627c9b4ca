"""The config's algorithm as a `lowcomm_jax.optim.replicated.ReplicatedAlgorithm`.

Data parallel is one replica with the inner optimizer (guarded against NaN/inf); DiLoCo and
Streaming DiLoCo are M replicas with `lowcomm_jax.streaming_diloco`, whose phase (which fragment
is sent or applied) is read on the host for each step; NoLoCo is M replicas with
`lowcomm_jax.noloco`, whose phase is the outer step's random grouping. The loop sees only the
interface, never the name.
"""

from __future__ import annotations

import ml_collections
import optax

from lowcomm_jax import codecs, optim
from lowcomm_jax import config as config_lib
from lowcomm_jax.optim import replicated
from lowcomm_jax.train import step as step_lib


def make_outer_optimizer(outer_cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
  builders = {
      "nesterov": lambda o: optim.outer_nesterov(o.learning_rate, o.momentum),
      "sgd": lambda o: optax.sgd(o.learning_rate, momentum=o.momentum or None),
      "adam": lambda o: optax.adam(o.learning_rate),
  }
  if outer_cfg.name not in builders:
    raise ValueError(f"outer_optimizer.name must be nesterov, sgd or adam, got {outer_cfg.name!r}")
  return builders[outer_cfg.name](outer_cfg)


def _codec(name: str, block_size: int, rounding: str = "nearest"):
  return None if name == "none" else codecs.get_codec(name, block_size, rounding)


def _data_parallel(config, inner, num_replicas, abstract_params):
  return replicated.DataParallel(inner, num_replicas)


def _noloco(config, inner, num_replicas, abstract_params):
  n = config.noloco
  tx = optim.noloco(inner, num_replicas, sync_every=n.sync_every, group_size=n.group_size,
                    momentum=n.outer_momentum, learning_rate=n.outer_learning_rate, gamma=n.gamma,
                    seed=config.seed, num_groupings=n.num_groupings,
                    codec=_codec(n.codec, n.codec_block_size))
  return replicated.NoLoCoAlgorithm(tx, num_replicas)


def _diloco_family(config, inner, num_replicas, abstract_params):
  d = config.diloco
  tx = optim.streaming_diloco(
      inner, make_outer_optimizer(config.outer_optimizer), sync_every=d.sync_every,
      fragments=config_lib.fragments_of(config), overlap_steps=d.overlap_steps, merge_alpha=d.merge_alpha,
      staggered=d.staggered, fragment_pattern=d.fragment_pattern,
      non_block_fragment=d.non_block_fragment,
      codec=_codec(d.codec, d.codec_block_size, d.codec_rounding), error_feedback=d.error_feedback,
      codec_kernels=d.codec_kernels, overlap_anchor=d.overlap_anchor)
  names = []
  if abstract_params is not None:  # a fragment rule that misses parameters fails here, before compute
    names = [f.name for f in tx.fragments(abstract_params)]
  return replicated.DiLoCoFamily(config.algorithm, tx, num_replicas, names)


BUILDERS = {"dp": _data_parallel, "diloco": _diloco_family, "streaming_diloco": _diloco_family,
            "noloco": _noloco}


def make_algorithm(config: ml_collections.ConfigDict, num_replicas: int,
                   abstract_params=None) -> replicated.ReplicatedAlgorithm:
  inner = step_lib.make_optimizer(config.optimizer, config.num_steps)
  return BUILDERS[config.algorithm](config, inner, num_replicas, abstract_params)
