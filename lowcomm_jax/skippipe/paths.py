"""Micro-batch paths, the timeline of tasks they cause, and the path rules.

In SkipPipe (arXiv 2502.19913) every micro-batch travels a *path*: the
ordered stages it visits, each on one node serving that stage. A path starts
at the micro-batch's own stage-0 (data-holding) node, visits exactly k of the
S stages (counting stage 0) in an order that allows only adjacent swaps, then
returns to the stage-0 node for the loss, and the backward pass walks the
same nodes in reverse. `Schedule.stage_paths()` gives, per micro-batch, the
ordered stage ids the model's path-conditioned forward runs.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple

import numpy as np

FORWARD, LOSS, BACKWARD = "F", "L", "B"


@dataclasses.dataclass(frozen=True)
class SkipConfig:
  """The convergence (CC) and throughput (TC) limits of a schedule.

  Attributes:
    path_length: k, stages each micro-batch visits counting stage 0 (the
      reference's PAT_LENGTH; 4 of 6 stages = 33% skipped).
    microbatches_per_data_node: micro-batches each stage-0 node injects per
      iteration (the reference's MB_COUNT).
    num_waves: rounds in which a data node can have micro-batches in flight;
      a node is on at most memory x num_waves paths per iteration, and a
      stage receives at most (its nodes x memory x num_waves) micro-batches.
    max_swaps: most adjacent swaps (steps back below the furthest stage
      reached) in one path.
    max_forward_jump: a path may jump at most this many stages beyond the
      furthest stage reached so far.
    paths_per_data_node: distinct paths planned per data node; each carries
      microbatches_per_data_node / paths_per_data_node micro-batches in a
      stream (the reference plans 1 path per data node; set it to
      microbatches_per_data_node to plan every micro-batch on its own).
  """

  path_length: int = 4
  microbatches_per_data_node: int = 6
  num_waves: int = 2
  max_swaps: int = 2
  max_forward_jump: int = 4
  paths_per_data_node: int = 1

  @property
  def stream_length(self) -> int:
    return self.microbatches_per_data_node // self.paths_per_data_node

  def validate(self, num_stages: int, stage_sizes, memory) -> None:
    """Raises ValueError naming the option when the limits cannot be met."""
    if not 1 <= self.path_length <= num_stages:
      raise ValueError(
          f"path_length: must be between 1 and the number of stages "
          f"({num_stages}), got {self.path_length}.")
    if self.microbatches_per_data_node < 1:
      raise ValueError(f"microbatches_per_data_node: must be >= 1, got "
                       f"{self.microbatches_per_data_node}.")
    if self.num_waves < 1:
      raise ValueError(f"num_waves: must be >= 1, got {self.num_waves}.")
    if self.max_swaps < 0 or self.max_forward_jump < 1:
      raise ValueError(f"max_swaps must be >= 0 and max_forward_jump >= 1, "
                       f"got {self.max_swaps} and {self.max_forward_jump}.")
    if (self.paths_per_data_node < 1 or self.microbatches_per_data_node
        % self.paths_per_data_node):
      raise ValueError(
          f"paths_per_data_node: must divide microbatches_per_data_node="
          f"{self.microbatches_per_data_node}, got {self.paths_per_data_node}.")
    memory = np.asarray(memory)
    allowed = int(memory.min()) * self.num_waves
    if self.microbatches_per_data_node > allowed:
      raise ValueError(
          f"microbatches_per_data_node: at most memory x num_waves = "
          f"{int(memory.min())} x {self.num_waves} = {allowed} micro-batches "
          f"fit on a node per iteration, got "
          f"{self.microbatches_per_data_node}.")


@dataclasses.dataclass(frozen=True)
class MicrobatchPath:
  """One micro-batch's route.

  Attributes:
    microbatch: id of the micro-batch within the iteration.
    stages: ordered stage ids it visits; starts with 0.
    nodes: the node serving each visited stage; nodes[0] is its data node.
    release_s: when its first forward may start.
  """

  microbatch: int
  stages: tuple[int, ...]
  nodes: tuple[int, ...]
  release_s: float = 0.0

  @property
  def data_node(self) -> int:
    return self.nodes[0]


class Task(NamedTuple):
  """One unit of work on one node: forward, loss or backward."""

  microbatch: int
  node: int
  stage: int
  kind: str
  start: float
  end: float


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per-micro-batch paths and, when the scheduler planned one, a timeline.

  Attributes:
    paths: one entry per micro-batch, ordered by micro-batch id.
    method: which scheduler produced it.
    planned_tasks: the scheduler's own timeline (empty for baselines that do
      not plan time); the simulator computes the executed one.
    stats: scheduler diagnostics (run time, search expansions, ...).
  """

  paths: tuple[MicrobatchPath, ...]
  method: str = ""
  planned_tasks: tuple[Task, ...] = ()
  stats: dict = dataclasses.field(default_factory=dict)

  def stage_paths(self) -> list[np.ndarray]:
    """int[k] per micro-batch: the stages it runs, in execution order."""
    return [np.array(p.stages, np.int64) for p in self.paths]

  def layer_paths(self, layers_per_stage: int) -> list[np.ndarray]:
    """int[k * layers_per_stage] per micro-batch: layer indices in order.

    A swapped path runs the two stages' layer blocks in swapped order, each
    block in its own order (docs/algorithms.md §3.4).
    """
    offsets = np.arange(layers_per_stage)
    return [np.concatenate([s * layers_per_stage + offsets for s in p.stages])
            for p in self.paths]


def task_sequence(stages, nodes, forward_s, loss_multiplier,
                  backward_multiplier) -> list[tuple[int, int, str, float]]:
  """The tasks of one micro-batch in order: (node, stage, kind, duration).

  Forward along the path, loss back on the data node, then backward along
  the reversed path ending on the data node.
  """
  tasks = [(n, s, FORWARD, float(forward_s[n])) for s, n in zip(stages, nodes)]
  tasks.append((nodes[0], 0, LOSS, float(forward_s[nodes[0]]) * loss_multiplier))
  tasks += [(n, s, BACKWARD, float(forward_s[n]) * backward_multiplier)
            for s, n in zip(reversed(stages), reversed(nodes))]
  return tasks


def next_stages(stages: tuple[int, ...], num_stages: int, config: SkipConfig
                ) -> Iterator[tuple[int, bool]]:
  """Stages a path may visit next under the convergence constraints.

  Yields (stage, is_swap). A forward step goes to an unvisited stage above
  the furthest reached, at most `max_forward_jump` beyond it; a swap steps
  back to the stage just below the furthest reached (swap distance 1) if it
  is unvisited, at most `max_swaps` times. Candidates that would leave too
  few stages to finish the path are dropped.
  """
  frontier = max(stages)
  swaps = count_swaps(stages)
  remaining = config.path_length - len(stages)
  if remaining <= 0:
    return
  below = frontier - 1
  if (swaps < config.max_swaps and below > 0 and below not in stages):
    yield below, True
  for stage in range(frontier + 1,
                     min(num_stages, frontier + config.max_forward_jump + 1)):
    # After jumping to `stage`, the path can still add stages above it or
    # the one just below it; keep only jumps that leave enough of them.
    room = num_stages - 1 - stage + (1 if stage - 1 > frontier else 0)
    if room >= remaining - 1:
      yield stage, False


def count_swaps(stages) -> int:
  """Steps in `stages` that go below the furthest stage reached before."""
  swaps, frontier = 0, stages[0]
  for stage in stages[1:]:
    if stage < frontier:
      swaps += 1
    frontier = max(frontier, stage)
  return swaps


def enumerate_stage_paths(num_stages: int, config: SkipConfig
                          ) -> list[tuple[int, ...]]:
  """Every stage sequence the convergence constraints allow (small S only)."""
  done, frontier = [], [(0,)]
  while frontier:
    grown = []
    for stages in frontier:
      if len(stages) == config.path_length:
        done.append(stages)
        continue
      grown += [stages + (s,) for s, _ in next_stages(stages, num_stages, config)]
    frontier = grown
  return done
