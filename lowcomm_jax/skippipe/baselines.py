"""Baselines SkipPipe is measured against (docs/algorithms.md §3.3 step 4).

* Full pipeline (DT-FM, Yuan et al. 2022): no skipping. Pipeline j is node j
  of every stage (after `placement.order_for_pipelines`); there are as many
  pipelines as the smallest stage has nodes, and the iteration's micro-batches
  (as many as SkipPipe processes) are dealt round-robin over them.
* Network-blind skipping (DT-FM-skip): skip paths planned by the same
  scheduler on a uniform-cost graph (every link and node alike, seeded jitter
  to break ties), without the collision step; it knows the load limits but
  not the network.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from lowcomm_jax.skippipe import inputs, paths as paths_lib, scheduler
from lowcomm_jax.skippipe.topology import Topology


def full_pipeline_schedule(topology: Topology, placement,
                           config: paths_lib.SkipConfig = paths_lib.SkipConfig(),
                           *, total_microbatches: int | None = None
                           ) -> paths_lib.Schedule:
  """Every micro-batch runs all S stages in order on one fixed pipeline.

  Args:
    topology: the cluster.
    placement: node ids per stage, ordered so node j of each stage forms
      pipeline j.
    config: only `microbatches_per_data_node` is used (the total work).
    total_microbatches: overrides the total (the reference's own baseline
      ran 9 per pipeline, 27 in all, instead of SkipPipe's 30).

  Returns:
    The `Schedule` (all releases at 0; memory limits admission in the
    simulator).
  """
  placement = inputs.validate_placement(topology, placement)
  num_pipelines = min(len(nodes) for nodes in placement)
  total = total_microbatches or (len(placement[0])
                                 * config.microbatches_per_data_node)
  stages = tuple(range(topology.num_stages))
  paths = []
  for m in range(total):
    j = m % num_pipelines
    nodes = tuple(int(placement[s][j]) for s in stages)
    paths.append(paths_lib.MicrobatchPath(m, stages, nodes, 0.0))
  return paths_lib.Schedule(paths=tuple(paths), method="full_pipeline",
                            stats=dict(scheduler_s=0.0,
                                       pipelines=num_pipelines))


def uniform_cost_topology(topology: Topology, seed: int = 0) -> Topology:
  """The same cluster with every link costing ~1 s and every node ~1 s."""
  rng = np.random.default_rng(seed)
  n = topology.num_nodes
  jitter = rng.uniform(0.0, 1e-3, size=(n, n))
  link = 1.0 + (jitter + jitter.T) / 2
  forward = 1.0 + rng.uniform(0.0, 1e-3, size=n)
  return topology.with_costs(link, forward)


def network_blind_schedule(topology: Topology, placement,
                           config: paths_lib.SkipConfig = paths_lib.SkipConfig(),
                           *, seed: int = 0,
                           budget: scheduler.SearchBudget = scheduler.SearchBudget()
                           ) -> paths_lib.Schedule:
  """Skip paths planned without looking at the network (DT-FM-skip).

  Releases are reset to 0: times planned on uniform costs mean nothing on
  the real network, so micro-batches simply start as memory allows.
  """
  started = time.perf_counter()
  blind = scheduler.skippipe_schedule(
      topology, placement, config, collision_aware=False,
      budget=dataclasses.replace(budget, seed=seed),
      plan_topology=uniform_cost_topology(topology, seed),
      method="network_blind")
  paths = tuple(dataclasses.replace(p, release_s=0.0) for p in blind.paths)
  stats = dict(blind.stats, scheduler_s=time.perf_counter() - started)
  return dataclasses.replace(blind, paths=paths, planned_tasks=(),
                             stats=stats)
