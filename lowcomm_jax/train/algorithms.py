"""The config's algorithm as a `lowcomm_jax.optim.replicated.ReplicatedAlgorithm`, and its checks.

Data parallel is one replica with the inner optimizer (guarded against NaN/inf); DiLoCo and
Streaming DiLoCo are M replicas with `lowcomm_jax.streaming_diloco`, whose phase (which fragment
is sent or applied) is read on the host for each step; NoLoCo is M replicas with
`lowcomm_jax.noloco`, whose phase is the outer step's random grouping; SparseLoCo is M replicas
with `lowcomm_jax.sparseloco`, phased as Streaming DiLoCo. The loop sees only the
interface, never the name.

Each entry of ALGORITHMS pairs the builder with `check_config` (the checks of the config sections
the algorithm reads and the replica counts it allows) and declares those `sections` (`outer.*`,
the DiLoCo family's shared schedule and wire; `outer_optimizer.*`; a method's own, `noloco.*`,
`sparseloco.*`). `train.validation.validate` calls the selected row's check and every declared
section's value checks, so a sixth algorithm brings its checks with it.
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
    "nesterov": lambda o: optim.delayed_nesterov(o.learning_rate, o.momentum,
                                                 o.momentum_every),
    "sgd": lambda o: optax.sgd(o.learning_rate, momentum=o.momentum or None),
    "adam": lambda o: optax.adam(o.learning_rate),
}


def make_outer_optimizer(outer_cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
  checks.require(outer_cfg.name in _OUTER_OPTIMIZERS, "outer_optimizer.name",
                 "nesterov, sgd or adam",
                 outer_cfg.name)
  return _OUTER_OPTIMIZERS[outer_cfg.name](outer_cfg)


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


def _schedule_arguments(o) -> dict:
  """The `outer` section's schedule and fragment layout, as the DiLoCo family's transforms take
  them (fragments: the parsed fragment_rules table, else num_fragments)."""
  fragments = frag_lib.parse_rules(o.fragment_rules) if o.fragment_rules else o.num_fragments
  return dict(sync_every=o.sync_every, fragments=fragments, overlap_steps=o.overlap_steps,
              merge_alpha=o.merge_alpha, staggered=o.staggered,
              fragment_pattern=o.fragment_pattern, non_block_fragment=o.non_block_fragment,
              overlap_anchor=o.overlap_anchor)


def _family(config, tx, num_replicas, abstract_params) -> replicated.DiLoCoFamily:
  names = []
  if abstract_params is not None:
    # a fragment rule that misses parameters fails here, before compute
    names = [f.name for f in tx.fragments(abstract_params)]
  return replicated.DiLoCoFamily(config.algorithm, tx, num_replicas, names)


def _diloco_family(config, inner, num_replicas, abstract_params, outer_transform=None):
  o = config.outer
  outer = make_outer_optimizer(config.outer_optimizer)
  tx = optim.streaming_diloco(
      inner, outer_transform(outer) if outer_transform else outer, **_schedule_arguments(o),
      codec=_codec(o.codec, o.codec_block_size, o.codec_rounding), error_feedback=o.error_feedback,
      codec_kernels=o.codec_kernels, eager=o.eager, naive_delay=o.naive_delay)
  return _family(config, tx, num_replicas, abstract_params)


def _check_replica_counts(c) -> None:
  checks.require(c.num_replicas >= 1, "num_replicas", ">= 1 (the number of DiLoCo workers M)",
                 c.num_replicas)
  checks.require(c.mesh.replica >= 1 and c.num_replicas % c.mesh.replica == 0, "mesh.replica",
                 f"a divisor of num_replicas={c.num_replicas}", c.mesh.replica)


def _check_outer_schedule(c) -> None:
  """The `outer` schedule of a DiLoCo-family run: the replica counts, H against num_steps and the
  fragment count, τ against H/P, the fragment rules' table (`check_every_section` checks the
  section's values alone)."""
  o = c.outer
  _check_replica_counts(c)
  checks.require(not o.fragment_rules or o.num_fragments == 1, "outer.num_fragments",
                 "1 when outer.fragment_rules is set (the rules give the fragments)",
                 o.num_fragments)
  num_rows = streaming.count_fragments(_schedule_arguments(o)["fragments"], o.non_block_fragment)
  checks.sync_every(o.sync_every, num_steps=c.num_steps,
                    num_fragments=num_rows if o.staggered else 1)
  schedule.make_schedule(num_rows, o.sync_every, o.overlap_steps, o.merge_alpha, o.staggered,
                         o.overlap_anchor, _one_outer_step_late(o))


def _check_streaming_diloco(c) -> None:
  o = c.outer
  _check_outer_schedule(c)
  checks.require(not o.error_feedback or o.codec != "none", "outer.error_feedback",
                 "False unless outer.codec is set", o.error_feedback)
  checks.require(not (o.eager and o.error_feedback), "outer.eager",
                 "False with outer.error_feedback (the worker takes its own Δ out of the landed "
                 "mean, which holds Δ's encoding plus the resent residual)", o.eager)
  checks.require(not (o.naive_delay and (o.eager or o.error_feedback)), "outer.naive_delay",
                 "False with outer.eager or outer.error_feedback (the delayed mean is applied as "
                 "it lands, no proxy, no residual)", o.naive_delay)


def _check_outer_values(c) -> None:
  """The `outer` section's values that are wrong whatever the rest of the config says."""
  o = c.outer
  _check_codec(c, "outer")
  checks.require(o.codec_rounding in codec_base.ROUNDING_MODES, "outer.codec_rounding",
                 f"one of {', '.join(codec_base.ROUNDING_MODES)}", o.codec_rounding)
  checks.require(o.overlap_executor in overlap.OVERLAP_EXECUTORS, "outer.overlap_executor",
                 f"one of {', '.join(overlap.OVERLAP_EXECUTORS)}", o.overlap_executor)
  checks.require(o.codec_kernels in codecs.KERNEL_MODES, "outer.codec_kernels",
                 f"one of {codecs.KERNEL_MODES}", o.codec_kernels)
  checks.require(o.overlap_anchor in schedule.OVERLAP_ANCHORS, "outer.overlap_anchor",
                 f"one of {schedule.OVERLAP_ANCHORS}", o.overlap_anchor)
  checks.integer(c, "outer.num_fragments", 1)
  checks.integer(c, "outer.overlap_steps", 0)
  checks.number(c, "outer.merge_alpha", 0, 1, high_open=False)
  checks.require(isinstance(o.eager, bool), "outer.eager", "True or False", o.eager)
  checks.require(isinstance(o.naive_delay, bool), "outer.naive_delay", "True or False",
                 o.naive_delay)


def _one_outer_step_late(o) -> bool:
  """Eager updates and the naive delay both apply a fragment's mean D = 1 or 2 outer steps late
  (τ = D·H)."""
  return bool(o.eager or o.naive_delay)


def _check_outer_optimizer(c) -> None:
  make_outer_optimizer(c.outer_optimizer)  # its name
  checks.number(c, "outer_optimizer.learning_rate", 0, low_open=True)
  checks.number(c, "outer_optimizer.momentum", 0, 1)
  checks.integer(c, "outer_optimizer.momentum_every", 1, note=" (N outer gradients per momentum "
                 "step: Delayed Nesterov)")
  checks.require(c.outer_optimizer.momentum_every == 1 or c.outer_optimizer.name == "nesterov",
                 "outer_optimizer.momentum_every", "1 unless outer_optimizer.name=nesterov",
                 c.outer_optimizer.momentum_every)


def _sparseloco(config, inner, num_replicas, abstract_params):
  s = config.sparseloco
  tx = optim.sparseloco(
      inner, **_schedule_arguments(config.outer), chunk_size=s.chunk_size, top_k=s.top_k,
      bits=s.bits, feedback_decay=s.feedback_decay, outer_learning_rate=s.outer_learning_rate)
  return _family(config, tx, num_replicas, abstract_params)


def _check_sparseloco(c) -> None:
  o = c.outer
  # its wire format is the sparseloco section's: a codec set here would be silently unused
  checks.require(o.codec == "none" and not o.error_feedback, "outer.codec/error_feedback",
                 "'none'/False for algorithm=sparseloco (its outer gradients travel as "
                 "sparseloco.top_k of each sparseloco.chunk_size, at sparseloco.bits bits)",
                 (o.codec, o.error_feedback))
  checks.require(c.gradients == "replicas" or (o.num_fragments == 1 and not o.fragment_rules),
                 "outer.num_fragments/fragment_rules",
                 f"1/'' with gradients={c.gradients} (fragments are cut by layer, stages too)",
                 (o.num_fragments, o.fragment_rules))
  checks.require(not _one_outer_step_late(o), "outer.eager/naive_delay",
                 "False/False for algorithm=sparseloco (the landed mean holds the top-k encoding "
                 "plus the resent error buffer)", (o.eager, o.naive_delay))
  _check_outer_schedule(c)


def _check_sparseloco_values(c) -> None:
  """The `sparseloco` section's values that are wrong whatever the rest of the config says."""
  s = c.sparseloco
  checks.number(c, "sparseloco.feedback_decay", 0, 1, high_open=False)
  checks.number(c, "sparseloco.outer_learning_rate", 0, low_open=True)
  TopKCompressor(s.chunk_size, s.top_k, s.bits)  # chunk_size, top_k <= chunk_size, bits: named


# Each section an algorithm may read, and the checks of its values that hold whatever the rest of
# the config says (`check_every_section`).
SECTION_CHECKS = {
    "outer": _check_outer_values,
    "outer_optimizer": _check_outer_optimizer,
    "noloco": _check_noloco_values,
    "sparseloco": _check_sparseloco_values,
}


def check_every_section(c: ml_collections.ConfigDict) -> None:
  """The values of every section an algorithm reads, read or not by the config's algorithm.

  A value that no algorithm accepts (`noloco.gamma=-1` in a DiLoCo run, `outer.codec_rounding=up`
  without a codec) is a mistake in the command line or the config file, not a harmless leftover.
  """
  for section in sorted({s for row in ALGORITHMS.values() for s in row.sections}):
    SECTION_CHECKS[section](c)


def _check_diloco(c) -> None:
  """Vanilla DiLoCo: Streaming DiLoCo with one fragment, τ = 0, α = 0 (docs/algorithms.md §1.1)."""
  o = c.outer
  late = _one_outer_step_late(o)  # eager or naively delayed DiLoCo overlaps whole outer phases
  taus = (o.sync_every, 2 * o.sync_every) if late else (0,)
  checks.require(o.num_fragments == 1 and o.overlap_steps in taus and o.merge_alpha == 0.0
                 and not o.fragment_rules,
                 "outer.num_fragments/overlap_steps/merge_alpha/fragment_rules",
                 f"1/{'outer.sync_every or twice it' if late else 0}/0/'' for algorithm=diloco "
                 f"{'with outer.eager or naive_delay ' if late else ''}"
                 "(use algorithm=streaming_diloco)",
                 (o.num_fragments, o.overlap_steps, o.merge_alpha, o.fragment_rules))
  _check_streaming_diloco(c)


class Algorithm(NamedTuple):
  """One value of the config's `algorithm`."""

  # (config, inner optimizer, M, abstract parameters or None) -> the loop's interface
  build: Callable[..., replicated.ReplicatedAlgorithm]
  # config -> None; one ValueError naming the option and its allowed values, before any compute
  check_config: Callable[[ml_collections.ConfigDict], None]
  # the config sections of SECTION_CHECKS it reads (every algorithm reads the general ones:
  # model, data, optimizer, mesh, ...): the docs' table of who reads what follows from these
  sections: tuple[str, ...] = ()


ALGORITHMS = {
    "dp": Algorithm(_data_parallel, _check_data_parallel),
    "diloco": Algorithm(_diloco_family, _check_diloco, ("outer", "outer_optimizer")),
    "streaming_diloco": Algorithm(_diloco_family, _check_streaming_diloco,
                                  ("outer", "outer_optimizer")),
    "noloco": Algorithm(_noloco, _check_noloco, ("noloco",)),
    "sparseloco": Algorithm(_sparseloco, _check_sparseloco, ("outer", "sparseloco")),
}


def make_algorithm(config: ml_collections.ConfigDict, num_replicas: int,
                   abstract_params=None, outer_transform=None) -> replicated.ReplicatedAlgorithm:
  """The config's algorithm on `num_replicas` replicas. `outer_transform` (DiLoCo family only):
  a function of the outer optimizer giving the one the algorithm steps with (the elastic syncer's
  HeLoCo alignment, `elastic.options.outer_algorithm`)."""
  inner = inner_lib.make_optimizer(config.optimizer, config.num_steps)
  build = ALGORITHMS[config.algorithm].build
  if outer_transform is None:
    return build(config, inner, num_replicas, abstract_params)
  return build(config, inner, num_replicas, abstract_params, outer_transform=outer_transform)
