"""The bubble: busy and idle ticks per device, planned, measured, and predicted by the simulator.

The SkipPipe iteration simulator (`skippipe.simulator`) plays a schedule out in continuous time on a
topology. With unit costs (forward, loss and backward one second each, links free, no per-task gap,
no all-reduce) on a grid of S stages × R identical nodes, its time is the tick count and its idle
seconds per node are idle ticks: `simulated_idle_ticks` gives them for the same routes and policy
the tick compiler used, to set next to the executor's measured idle ticks.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lowcomm_jax.parallel.ticks import TickTable
from lowcomm_jax.skippipe import paths as paths_lib, simulator, topology


def grid_placement(num_stages: int, num_replicas: int) -> list[np.ndarray]:
  """Node ids per stage on a grid topology: replica r of stage s is node s·R + r."""
  return [np.arange(s * num_replicas, (s + 1) * num_replicas) for s in range(num_stages)]


def unit_cost_topology(num_stages: int, num_replicas: int, memory: int) -> topology.Topology:
  """S × R identical nodes; forward, loss and backward take 1 s, links 0 s."""
  grid = topology.homogeneous((num_replicas,) * num_stages, forward_s=1.0, link_cost_s=0.0,
                              memory=memory, layers_per_stage=1)
  return dataclasses.replace(grid, loss_multiplier=1.0, backward_multiplier=1.0)


def simulate_unit_costs(table: TickTable, memory: int) -> simulator.IterationResult:
  """The simulator's run of `table`'s routes with unit costs and `table.order`'s policy."""
  s, r = table.num_stages, table.num_replicas
  placement = grid_placement(s, r)
  paths = tuple(paths_lib.MicrobatchPath(m, route.stages,
                                         tuple(int(placement[st][rep]) for st, rep in
                                               zip(route.stages, route.replicas)), 0.0)
                for m, route in enumerate(table.routes))
  config = simulator.SimulationConfig(task_gap_s=0.0, include_allreduce=False,
                                      backward_first=table.order == "1f1b")
  return simulator.simulate_iteration(unit_cost_topology(s, r, memory), placement,
                                      paths_lib.Schedule(paths), config)


def simulated_idle_ticks(table: TickTable, memory: int) -> tuple[int, np.ndarray]:
  """(makespan in ticks, int[D] idle ticks per device in the executor's device order r·S + s)."""
  result = simulate_unit_costs(table, memory)
  s, r = table.num_stages, table.num_replicas
  node_of_device = [st * r + rep for rep in range(r) for st in range(s)]  # device d = rep·S + st
  idle = np.rint(result.node_idle_s[node_of_device]).astype(np.int64)
  return int(round(result.pipeline_time_s)), idle
