"""The configs an elastic run derives from the user's, and its checks before anything starts.

An elastic run with N = `elastic.num_learners` is the SPMD run of the same config with
`num_replicas = N`, cut in two:

  learner i   `learner_config`: the run's algorithm on one replica, on its own mesh
              (mesh.data × mesh.tensor), reading shard i of N; its plans travel through the syncer
              (`train.overlap.Remote`)
  syncer      φ and the outer optimizer state, the shared part of `outer_algorithm`'s state (the
              SPMD run's algorithm), and the rounds of its plans

Any algorithm whose plans a syncer carries runs elastic (`comm.remote.REMOTE_KINDS`: DiLoCo,
Streaming DiLoCo, SparseLoCo); another is refused in one line (`check`).
"""

from __future__ import annotations

import copy
import hashlib
import os
import pathlib

from lowcomm_jax import checks, config as config_lib, run_config
from lowcomm_jax.train import faults, overlap, validation


def namespace(run_dir) -> str:
  """The Ray namespace of the run in `run_dir` (two runs on one cluster never share actors)."""
  return (
    "lowcomm-" + hashlib.sha256(str(pathlib.Path(run_dir).absolute()).encode()).hexdigest()[:16]
  )


def learner_name(learner: int) -> str:
  return f"learner-{learner}"


def use_compilation_cache(run_dir) -> None:
  """JAX's persistent compilation cache, so that a restarted or added learner compiles nothing
  again: JAX_COMPILATION_CACHE_DIR where the environment sets it (shared by runs), else
  <run_dir>/jax_cache."""
  import jax  # pylint: disable=g-import-not-at-top
  folder = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(pathlib.Path(run_dir) / "jax_cache")
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def num_learners(config) -> int:
  return int(config.elastic.num_learners)


def data_shard(config, learner: int) -> tuple[int, int]:
  """(shard, number of shards) learner `learner` reads: i of N for the run's N learners, as SPMD
  replica i; a learner added while the run goes on (i ≥ N) reads shard i of i + 1 (its windows
  overlap those of the learners it was added to, which read on from where they are)."""
  return learner, max(num_learners(config), learner + 1)


def quorum(config) -> int:
  """Δ_p a round waits for (before the grace window), when every learner is live."""
  return int(config.elastic.min_quorum) or num_learners(config)


def _derived(config, changes: dict):
  """`config` with dotted keys changed, of its own kind: a checked `run_config.RunConfig` gives one
  (its sections were checked, the changes keep them valid), a ConfigDict a changed copy."""
  if isinstance(config, run_config.RunConfig):
    return run_config.replace(config, changes)
  return config_lib.override(copy.deepcopy(config), changes)


def spmd_config(config):
  """The SPMD run an elastic run equals when nothing fails: num_replicas = N, one replica per
  slot."""
  return _derived(config, {"num_replicas": num_learners(config), "mesh.replica": 1})


def local_steps(config, learner: int) -> tuple[int, int]:
  """(H_i, steps) of learner `learner`: outer.sync_every and num_steps, or with
  `elastic.local_steps=by_speed` H_i = max(1, round(H·s_i / max s)) from its declared speed s_i
  and num_steps·H_i/H steps (the same number of outer phases as the others, each taking about the
  same wall time: DyLU with the declared speeds). A learner added while the run goes on counts as
  one of the fastest."""
  c = config
  if c.elastic.local_steps != "by_speed":
    return int(c.outer.sync_every), int(c.num_steps)
  speeds = faults.speeds(c.elastic.speeds, num_learners(c))
  speed = speeds[learner] if learner < len(speeds) else max(speeds)
  h = max(1, round(c.outer.sync_every * speed / max(speeds)))
  return h, max(h, round(c.num_steps * h / c.outer.sync_every))


def learner_config(config, learner: int = 0):
  """Learner `learner`'s Trainer config: the run's algorithm on a single replica (its plans carried
  by the syncer, not by a thread), with its own H and steps (`local_steps`)."""
  h, steps = local_steps(config, learner)
  return _derived(config, {"num_replicas": 1, "mesh.replica": 1,
                           "outer.overlap_executor": "inline", "outer.sync_every": h,
                           "num_steps": steps})


def evaluation_config(config):
  """The syncer's: one replica of the inner optimizer alone on one device (it evaluates φ and
  holds no accelerator)."""
  return _derived(learner_config(config), {"algorithm": "dp", "mesh.data": 1, "mesh.tensor": 1,
                                           "sharding.layout": "replicated"})


def outer_algorithm(config, abstract_params=None):
  """The SPMD run's algorithm (`optim.replicated`: schedule, fragments, outer optimizer, plans);
  asynchronous with `elastic.staleness=heloco`, its outer optimizer aligns each Δ with its
  momentum first (`merge_correction`)."""
  from lowcomm_jax.train import algorithms  # pylint: disable=g-import-not-at-top
  return algorithms.make_algorithm(spmd_config(config), num_learners(config), abstract_params,
                                   merge_correction(config))


def merge_correction(config):
  """None, or with asynchronous learners under `elastic.staleness=heloco` the function wrapping
  the syncer's outer optimizer in `optim.alignment.heloco` with the elastic.heloco_* values (its
  state is the outer optimizer's own: the learners, the checkpoint and the replay see no
  difference)."""
  e = config.elastic
  if not (e.asynchronous and e.staleness == "heloco"):
    return None
  from lowcomm_jax.optim import alignment  # pylint: disable=g-import-not-at-top
  values = {name: e[f"heloco_{name}"] for name in alignment.RANGES}
  return lambda outer: alignment.heloco(outer, **values)


def syncer_algorithm(config, abstract_params=None):
  """The algorithm of the syncer's φ: the SPMD run's, or with eager outer updates (or the naive
  delay) DiLoCo's outer step on the same fragments with τ = 0. Eager workers each keep their own
  φ_m; the syncer steps one φ with every closed round's mean in turn, the φ that every worker's
  φ_m differs from only by its own latest share (docs/algorithms.md §1.7). It is what a
  (re)joining learner starts from and what the run evaluates."""
  o = config.outer
  if o.eager or o.naive_delay:
    config = _derived(config, {"outer.eager": False, "outer.naive_delay": False,
                               "outer.overlap_steps": 0})
  return outer_algorithm(config, abstract_params)


def plan_names(tx) -> list[str]:
  """The names of the algorithm's plans in natural order ("fragment 0", "fragment 0, lane 1",
  "fragment 1", …): plan p of the syncer's rounds."""
  names = []
  for phase in tx.phases:
    names += [n for n in tx.plans(phase) if n not in names]
  return sorted(names, key=lambda n: [int(t) if t.isdigit() else t
                                      for t in n.replace(",", " ").split()])


def check(config) -> run_config.RunConfig:
  """Every check of an elastic run, before Ray starts: one ValueError line naming the option.

  The configuration is checked once; the SPMD run's, the learners' and the syncer's differ from it
  only in the replica count, the overlap executor (the learners' plans go through the syncer), the
  algorithm of the syncer's evaluation (dp: the inner optimizer) and the mesh, which keep every
  checked value valid (N >= 1 replicas of one slot each; one replica of data parallel).
  """
  checks.require(config.gradients == "replicas", "gradients", "replicas for an elastic run",
                 config.gradients)
  try:
    tx = outer_algorithm(config).tx
  except (KeyError, ValueError):
    validation.validate(config)  # names the option the algorithm could not be built from
    raise
  try:
    overlap.check_remote(tx)
  except ValueError as error:
    raise ValueError(f"algorithm={config.algorithm} cannot run elastic: {error}") from None
  run = validation.validate(config)
  checks.require(run.outer.codec_rounding == "nearest", "outer.codec_rounding",
                 "nearest for an elastic run (stochastic rounding keys follow the SPMD step count)",
                 run.outer.codec_rounding)
  e = run.elastic
  if e.asynchronous:
    for key in ("eager", "naive_delay"):
      checks.require(not run.outer[key], f"outer.{key}",
                     "False with elastic.asynchronous=True (each Δ is merged as it arrives)",
                     run.outer[key])
    # (DiLoCo has τ = 0: the learner goes on from the φ its Δ was merged into)
    checks.require(run.algorithm == "diloco", "algorithm",
                   "diloco for elastic.asynchronous=True (one fragment, merged as it arrives)",
                   run.algorithm)
    if e.staleness == "heloco":  # the outer momentum is the direction each Δ is aligned with
      o = run.outer_optimizer
      checks.require(o.name == "nesterov" and o.momentum > 0, "outer_optimizer.name/momentum",
                     "nesterov/> 0 with elastic.staleness=heloco (the outer momentum is the "
                     "direction it aligns each Δ with)", (o.name, o.momentum))
  else:
    checks.require(e.staleness != "heloco", "elastic.staleness",
                   "inverse, cutoff or none unless elastic.asynchronous=True (heloco aligns each "
                   "Δ as it is merged)", e.staleness)
    for key, default in (("buffer_barrier", False), ("local_steps", "equal")):
      checks.require(e[key] == default, f"elastic.{key}",
                     f"{default} unless elastic.asynchronous=True (rounds need one H)", e[key])
  return run
