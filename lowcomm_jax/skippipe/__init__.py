"""SkipPipe (arXiv 2502.19913): topology, placement, path scheduler, simulator.

Modules, one concept each:
  topology     clusters, the reference's cost model and presets
  placement    node-to-stage placement search (step 1)
  paths        SkipConfig limits, MicrobatchPath / Schedule / Task, path rules
  search       best-first search for one micro-batch's path (step 2)
  inputs       input checks (placement, loads the stages can take)
  conflicts    conflicts between agents (load, memory, collisions)
  scheduler    conflict-based search over all paths (step 3)
  baselines    full pipeline (DT-FM) and network-blind skipping
  constraints  an independent checker of CC and TC
  simulator    event-driven iteration simulator
  gantt        Gantt charts, link-cost heat maps, placement plots

Typical use::

  from lowcomm_jax import skippipe
  topo = skippipe.topology.gcp_12_regions()
  placed = skippipe.placement.optimize_placement(topo, seed=0)
  schedule = skippipe.scheduler.skippipe_schedule(topo, placed)
  stage_paths = schedule.stage_paths()      # int[k] per micro-batch
  result = skippipe.simulator.simulate_iteration(topo, placed, schedule)
"""

from lowcomm_jax.skippipe import (
  baselines,
  conflicts,
  constraints,
  gantt,
  inputs,
  paths,
  placement,
  scheduler,
  search,
  simulator,
  topology,
)
from lowcomm_jax.skippipe.paths import MicrobatchPath, Schedule, SkipConfig
from lowcomm_jax.skippipe.scheduler import SearchBudget, skippipe_schedule
from lowcomm_jax.skippipe.simulator import SimulationConfig, simulate_iteration

__all__ = [
  "MicrobatchPath",
  "Schedule",
  "SearchBudget",
  "SimulationConfig",
  "SkipConfig",
  "baselines",
  "conflicts",
  "constraints",
  "gantt",
  "inputs",
  "paths",
  "placement",
  "scheduler",
  "search",
  "simulate_iteration",
  "simulator",
  "skippipe_schedule",
  "topology",
]
