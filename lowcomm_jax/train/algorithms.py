"""The config's algorithm as a `lowcomm_jax.optim.replicated.ReplicatedAlgorithm`, and its checks.

Data parallel is one replica with the inner optimizer (guarded against NaN/inf); DiLoCo and
Streaming DiLoCo are M replicas with `lowcomm_jax.streaming_diloco`, whose phase (which fragment
is sent or applied) is read on the host for each step; NoLoCo is M replicas with
`lowcomm_jax.noloco`, whose phase is the outer step's random grouping; SparseLoCo is M replicas
with `lowcomm_jax.sparseloco`, phased as Streaming DiLoCo. The loop sees only the
interface, never the name.

Each entry of ALGORITHMS pairs the builder with `check_config`, the checks of the config sections
the algorithm reads (`diloco.*`, `noloco.*`, `outer_optimizer.*`, the replica counts it allows);
`train.validation.validate` calls the selected one, so a sixth algorithm brings its checks with it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import ml_collections
import optax

from lowcomm_jax import checks, codecs, optim
from lowcomm_jax.codecs import base as codec_base
from lowcomm_jax.codecs.topk import TopKCompressor
from lowcomm_jax.optim import (
  fragments as frag_lib,
  inner as inner_lib,
  replicated,
  schedule,
  streaming,
)
from lowcomm_jax.train import overlap

_OUTER_OPTIMIZERS = {
    "nesterov": lambda o: optim.outer_nesterov(o.learning_rate, o.momentum),
    "sgd": lambda o: optax.sgd(o.learning_rate, momentum=o.momentum or None),
    "adam": lambda o: optax.adam(o.learning_rate),
}


def make_outer_optimizer(outer_cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
  checks.require(outer_cfg.name in _OUTER_OPTIMIZERS, "outer_optimizer.name",
                 "nesterov, sgd or adam",
                 outer_cfg.name)
  return _OUTER_OPTIMIZERS[outer_cfg.name](outer_cfg)


def fragments_of(c: ml_collections.ConfigDict):
  """`streaming_diloco`'s `fragments`: the parsed diloco.fragment_rules table, else
  diloco.num_fragments."""
  if c.diloco.fragment_rules:
    return frag_lib.parse_rules(c.diloco.fragment_rules)
  return c.diloco.num_fragments


def _codec(name: str, block_size: int, rounding: str = "nearest"):
  return None if name == "none" else codecs.get_codec(name, block_size, rounding)


def _check_codec(c, section: str) -> None:
  """`<section>.codec` and its block size: the outer gradients' wire format."""
  name = c[section].codec
  checks.require(name == "none" or name in codecs.CODECS, f"{section}.codec",
                 f"none or one of {list(codecs.CODECS)}", name)
  if name != "none":
    checks.integer(c, f"{section}.codec_block_size", 2, note=" (values per absmax scale)")


def _data_parallel(config, inner, num_replicas, abstract_params):
  return replicated.DataParallel(inner, num_replicas)


def _check_data_parallel(c) -> None:
  checks.require(c.num_replicas == 1 and c.mesh.replica == 1, "num_replicas and mesh.replica",
                 "1 for algorithm=dp (use diloco for replicas)", (c.num_replicas, c.mesh.replica))


def _noloco(config, inner, num_replicas, abstract_params):
  n = config.noloco
  tx = optim.noloco(inner, num_replicas, sync_every=n.sync_every, group_size=n.group_size,
                    momentum=n.outer_momentum, learning_rate=n.outer_learning_rate, gamma=n.gamma,
                    seed=config.seed, num_groupings=n.num_groupings,
                    codec=_codec(n.codec, n.codec_block_size))
  return replicated.NoLoCoAlgorithm(tx, num_replicas)


def _check_noloco(c) -> None:
  n = c.noloco
  checks.require(c.num_replicas >= 2, "num_replicas",
                 ">= 2 for algorithm=noloco (gossip needs peers)",
                 c.num_replicas)
  checks.require(n.group_size >= 2 and c.num_replicas % n.group_size == 0, "noloco.group_size",
                 f">= 2 and a divisor of num_replicas={c.num_replicas}", n.group_size)
  checks.require(c.mesh.replica in (1, c.num_replicas), "mesh.replica",
                 f"1 (replicas simulated on shared devices) or num_replicas={c.num_replicas} "
                 "(one replica per device group) for algorithm=noloco", c.mesh.replica)
  checks.sync_every(n.sync_every, "noloco.sync_every", num_steps=c.num_steps)
  _check_noloco_values(c)


def _check_noloco_values(c) -> None:
  """The `noloco` section's values that are wrong whatever the rest of the config says."""
  checks.number(c, "noloco.outer_learning_rate", 0, low_open=True)
  checks.number(c, "noloco.outer_momentum", 0, 1)
  checks.number(c, "noloco.gamma", 0)
  checks.integer(c, "noloco.group_size", 2)
  checks.integer(c, "noloco.num_groupings", 1)
  _check_codec(c, "noloco")


def _diloco_family(config, inner, num_replicas, abstract_params):
  d = config.diloco
  tx = optim.streaming_diloco(
      inner, make_outer_optimizer(config.outer_optimizer), sync_every=d.sync_every,
      fragments=fragments_of(config), overlap_steps=d.overlap_steps, merge_alpha=d.merge_alpha,
      staggered=d.staggered, fragment_pattern=d.fragment_pattern,
      non_block_fragment=d.non_block_fragment,
      codec=_codec(d.codec, d.codec_block_size, d.codec_rounding), error_feedback=d.error_feedback,
      codec_kernels=d.codec_kernels, overlap_anchor=d.overlap_anchor)
  names = []
  if abstract_params is not None:
    # a fragment rule that misses parameters fails here, before compute
    names = [f.name for f in tx.fragments(abstract_params)]
  return replicated.DiLoCoFamily(config.algorithm, tx, num_replicas, names)


def _check_replica_counts(c) -> None:
  checks.require(c.num_replicas >= 1, "num_replicas", ">= 1 (the number of DiLoCo workers M)",
                 c.num_replicas)
  checks.require(c.mesh.replica >= 1 and c.num_replicas % c.mesh.replica == 0, "mesh.replica",
                 f"a divisor of num_replicas={c.num_replicas}", c.mesh.replica)


def _check_streaming_diloco(c) -> None:
  d = c.diloco
  _check_replica_counts(c)
  checks.require(not d.fragment_rules or d.num_fragments == 1, "diloco.num_fragments",
                 "1 when diloco.fragment_rules is set (the rules give the fragments)",
                 d.num_fragments)
  num_rows = streaming.count_fragments(fragments_of(c), d.non_block_fragment)
  checks.sync_every(d.sync_every, num_steps=c.num_steps,
                    num_fragments=num_rows if d.staggered else 1)
  schedule.make_schedule(num_rows, d.sync_every, d.overlap_steps, d.merge_alpha, d.staggered,
                         d.overlap_anchor)
  _check_diloco_values(c)
  checks.require(not d.error_feedback or d.codec != "none", "diloco.error_feedback",
                 "False unless diloco.codec is set", d.error_feedback)
  _check_outer_optimizer(c)


def _check_diloco_values(c) -> None:
  """The `diloco` section's values that are wrong whatever the rest of the config says."""
  d = c.diloco
  _check_codec(c, "diloco")
  checks.require(d.codec_rounding in codec_base.ROUNDING_MODES, "diloco.codec_rounding",
                 f"one of {', '.join(codec_base.ROUNDING_MODES)}", d.codec_rounding)
  checks.require(d.overlap_executor in overlap.OVERLAP_EXECUTORS, "diloco.overlap_executor",
                 f"one of {', '.join(overlap.OVERLAP_EXECUTORS)}", d.overlap_executor)
  checks.require(d.codec_kernels in codecs.KERNEL_MODES, "diloco.codec_kernels",
                 f"one of {codecs.KERNEL_MODES}", d.codec_kernels)
  checks.require(d.overlap_anchor in schedule.OVERLAP_ANCHORS, "diloco.overlap_anchor",
                 f"one of {schedule.OVERLAP_ANCHORS}", d.overlap_anchor)
  checks.integer(c, "diloco.num_fragments", 1)
  checks.integer(c, "diloco.overlap_steps", 0)
  checks.number(c, "diloco.merge_alpha", 0, 1, high_open=False)


def _check_outer_optimizer(c) -> None:
  make_outer_optimizer(c.outer_optimizer)  # its name
  checks.number(c, "outer_optimizer.learning_rate", 0, low_open=True)
  checks.number(c, "outer_optimizer.momentum", 0, 1)


def _sparseloco(config, inner, num_replicas, abstract_params):
  s, d = config.sparseloco, config.diloco
  tx = optim.sparseloco(
      inner, sync_every=s.sync_every, fragments=s.num_fragments, overlap_steps=s.overlap_steps,
      merge_alpha=s.merge_alpha, chunk_size=s.chunk_size, top_k=s.top_k, bits=s.bits,
      feedback_decay=s.feedback_decay, outer_learning_rate=s.outer_learning_rate,
      staggered=d.staggered, fragment_pattern=d.fragment_pattern,
      non_block_fragment=d.non_block_fragment, overlap_anchor=d.overlap_anchor)
  names = [] if abstract_params is None else [f.name for f in tx.fragments(abstract_params)]
  return replicated.DiLoCoFamily(config.algorithm, tx, num_replicas, names)


def _check_sparseloco(c) -> None:
  s, d = c.sparseloco, c.diloco
  _check_replica_counts(c)
  checks.require(c.gradients == "replicas" or s.num_fragments == 1, "sparseloco.num_fragments",
                 f"1 with gradients={c.gradients} (fragments are cut by layer, stages too)",
                 s.num_fragments)
  num_rows = streaming.count_fragments(s.num_fragments, d.non_block_fragment)
  checks.sync_every(s.sync_every, "sparseloco.sync_every", num_steps=c.num_steps,
                    num_fragments=num_rows if d.staggered else 1)
  _check_sparseloco_values(c)
  schedule.make_schedule(num_rows, s.sync_every, s.overlap_steps, s.merge_alpha, d.staggered,
                         d.overlap_anchor, "sparseloco")


def _check_sparseloco_values(c) -> None:
  """The `sparseloco` section's values that are wrong whatever the rest of the config says."""
  s = c.sparseloco
  checks.integer(c, "sparseloco.num_fragments", 1)
  checks.integer(c, "sparseloco.overlap_steps", 0)
  checks.number(c, "sparseloco.merge_alpha", 0, 1, high_open=False)
  checks.number(c, "sparseloco.feedback_decay", 0, 1, high_open=False)
  checks.number(c, "sparseloco.outer_learning_rate", 0, low_open=True)
  TopKCompressor(s.chunk_size, s.top_k, s.bits)  # chunk_size, top_k <= chunk_size, bits: named


def check_every_section(c: ml_collections.ConfigDict) -> None:
  """The values of every algorithm's section, read or not by the config's algorithm.

  A value that no algorithm accepts (`noloco.gamma=-1` in a DiLoCo run, `diloco.codec_rounding=up`
  without a codec) is a mistake in the command line or the config file, not a harmless leftover.
  """
  _check_diloco_values(c)
  _check_noloco_values(c)
  _check_sparseloco_values(c)
  _check_outer_optimizer(c)


def _check_diloco(c) -> None:
  """Vanilla DiLoCo: Streaming DiLoCo with one fragment, τ = 0, α = 0 (docs/algorithms.md §1.1)."""
  d = c.diloco
  checks.require(d.num_fragments == 1 and d.overlap_steps == 0 and d.merge_alpha == 0.0
                 and not d.fragment_rules,
                 "diloco.num_fragments/overlap_steps/merge_alpha/fragment_rules",
                 "1/0/0/'' for algorithm=diloco (use algorithm=streaming_diloco)",
                 (d.num_fragments, d.overlap_steps, d.merge_alpha, d.fragment_rules))
  _check_streaming_diloco(c)


class Algorithm(NamedTuple):
  """One value of the config's `algorithm`."""

  # (config, inner optimizer, M, abstract parameters or None) -> the loop's interface
  build: Callable[..., replicated.ReplicatedAlgorithm]
  # config -> None; one ValueError naming the option and its allowed values, before any compute
  check_config: Callable[[ml_collections.ConfigDict], None]


ALGORITHMS = {
    "dp": Algorithm(_data_parallel, _check_data_parallel),
    "diloco": Algorithm(_diloco_family, _check_diloco),
    "streaming_diloco": Algorithm(_diloco_family, _check_streaming_diloco),
    "noloco": Algorithm(_noloco, _check_noloco),
    "sparseloco": Algorithm(_sparseloco, _check_sparseloco),
}


def make_algorithm(config: ml_collections.ConfigDict, num_replicas: int,
                   abstract_params=None) -> replicated.ReplicatedAlgorithm:
  inner = inner_lib.make_optimizer(config.optimizer, config.num_steps)
  return ALGORITHMS[config.algorithm].build(config, inner, num_replicas, abstract_params)
