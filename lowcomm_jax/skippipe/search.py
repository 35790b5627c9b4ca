"""Best-first (A*-like) search for one micro-batch's path (SkipPipe step 2).

The search grows a path stage by stage over the node graph: each state is a
prefix of stages and the nodes serving them, with the time its last forward
ends. Waiting is part of the time: a task cannot overlap the agent's
forbidden windows on a node (constraints added by the conflict-based search,
docs/algorithms.md §3.3 step 3), so it starts at the first gap that fits. A state's key
is its time plus an admissible bound on what remains (forwards still to run,
the trip back to the stage-0 node for the loss, and the whole backward pass
along the reversed path). Completed paths are re-keyed with their exact
round-trip time, so the first completed path popped is the fastest one
satisfying the convergence constraints and the agent's constraints.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools

import numpy as np

from lowcomm_jax.skippipe import paths as paths_lib
from lowcomm_jax.skippipe.topology import Topology


@dataclasses.dataclass(frozen=True)
class AgentConstraints:
  """What the conflict-based search forbids one agent (micro-batch).

  Attributes:
    forbidden_nodes: nodes it may not visit.
    windows: node -> sorted ((start, end), ...) intervals its tasks on that
      node may not overlap.
  """

  forbidden_nodes: frozenset = frozenset()
  windows: tuple = ()        # ((node, start, end), ...), kept hashable

  def forbid_node(self, node: int) -> "AgentConstraints":
    return dataclasses.replace(self,
                               forbidden_nodes=self.forbidden_nodes | {node})

  def forbid_window(self, node: int, start: float, end: float
                    ) -> "AgentConstraints":
    return dataclasses.replace(self,
                               windows=self.windows + ((node, start, end),))

  def windows_by_node(self) -> dict[int, list[tuple[float, float]]]:
    by_node: dict[int, list[tuple[float, float]]] = {}
    for node, start, end in self.windows:
      by_node.setdefault(node, []).append((start, end))
    for intervals in by_node.values():
      intervals.sort()
    return by_node


def earliest_start(ready: float, duration: float, intervals) -> float:
  """First start >= ready such that [start, start + duration) avoids all
  `intervals` (sorted by start)."""
  start = ready
  for low, high in intervals:
    if start < high and start + duration > low:
      start = high
  return start


def plan_timeline(topology: Topology, microbatch: int, stages, nodes,
                  release_s: float, windows_by_node
                  ) -> list[paths_lib.Task]:
  """The agent's own timeline for a complete path, honouring its windows."""
  link = topology.link_cost_s
  tasks, ready, prev_node = [], release_s, None
  for node, stage, kind, duration in paths_lib.task_sequence(
      stages, nodes, topology.forward_s, topology.loss_multiplier,
      topology.backward_multiplier):
    if prev_node is not None:
      ready += link[prev_node, node]
    start = earliest_start(ready, duration, windows_by_node.get(node, ()))
    tasks.append(paths_lib.Task(microbatch, node, stage, kind, start,
                                start + duration))
    ready, prev_node = start + duration, node
  return tasks


def holds_of(tasks) -> dict[int, tuple[float, float]]:
  """node -> (first start, last end) of one micro-batch's tasks there."""
  spans: dict[int, tuple[float, float]] = {}
  for task in tasks:
    low, high = spans.get(task.node, (task.start, task.end))
    spans[task.node] = (min(low, task.start), max(high, task.end))
  return spans


def _memory_shortfall(spans, holds_by_node, memory) -> float:
  """0 if every node can hold the micro-batch over its span, else how much
  later it should start (until the first blocking holder leaves)."""
  for node, (low, high) in spans.items():
    others = holds_by_node.get(node, ())
    for point in [low] + [s for s, _ in others if low < s < high]:
      active = [e for s, e in others if s <= point < e]
      if len(active) >= memory[node]:
        return max(min(active) - low, 1e-6)
  return 0.0


def plan_stream(topology: Topology, first_microbatch: int, count: int,
                stages, nodes, windows_by_node, holds_by_node=None
                ) -> list[paths_lib.Task]:
  """Timeline of `count` micro-batches that share one path (a stream).

  The reference plans one path per data node and sends several micro-batches
  down it. They are planned in order, each avoiding the tasks of the ones
  before it, and each starts only once every node on its path has an
  activation slot free for as long as it holds it (TC1 memory), counting the
  stream's earlier micro-batches and `holds_by_node`, the (start, end) spans
  other agents already hold.
  """
  busy = {node: list(intervals) for node, intervals in windows_by_node.items()}
  holds = {node: list(spans) for node, spans in (holds_by_node or {}).items()}
  tasks = []
  for i in range(count):
    release = 0.0
    while True:
      own = plan_timeline(topology, first_microbatch + i, stages, nodes,
                          release, busy)
      spans = holds_of(own)
      delay = _memory_shortfall(spans, holds, topology.memory)
      if delay == 0.0:
        break
      release += delay
    for task in own:
      bisect.insort(busy.setdefault(task.node, []), (task.start, task.end))
    for node, span in spans.items():
      holds.setdefault(node, []).append(span)
    tasks += own
  return tasks


@dataclasses.dataclass(frozen=True)
class PathPlan:
  """A found path, its planned tasks and its cost."""

  stages: tuple[int, ...]
  nodes: tuple[int, ...]
  tasks: tuple[paths_lib.Task, ...]
  completion_s: float
  cost: float
  expansions: int


def find_path(topology: Topology, placement, config: paths_lib.SkipConfig,
              microbatch: int, data_node: int, *, stream_length: int = 1,
              constraints: AgentConstraints = AgentConstraints(),
              holds_by_node=None,
              node_penalty: np.ndarray | None = None,
              max_expansions: int = 50_000) -> PathPlan | None:
  """Best-first search for one micro-batch's fastest admissible path.

  Args:
    topology: the cluster (its costs drive the search).
    placement: node ids per stage.
    config: convergence limits (path length, swaps, forward jump).
    microbatch: id of the agent's first micro-batch (stamped on its tasks).
    data_node: its stage-0 node, where the path starts and ends.
    stream_length: micro-batches sent down the path (`plan_stream`); the
      path is scored by when the last of them finishes.
    constraints: nodes and time windows the agent must avoid.
    holds_by_node: node -> [(start, end)] activation spans other agents
      hold; the agent waits until it fits in memory (prioritized planning).
    node_penalty: float[N] extra cost (not time) per visit of a node; the
      conflict-based search uses it to steer agents off full nodes.
    max_expansions: search budget; the best complete path found by then is
      returned.

  Returns:
    The best `PathPlan`, or None when no path satisfies the constraints.
  """
  link = topology.link_cost_s
  forward = topology.forward_s
  backward = topology.backward_s
  penalty = (np.zeros(topology.num_nodes) if node_penalty is None
             else np.asarray(node_penalty, np.float64))
  windows = constraints.windows_by_node()
  stage_nodes = [[int(n) for n in nodes if int(n) not in
                  constraints.forbidden_nodes] for nodes in placement]
  num_stages = len(placement)
  off_diagonal = link[~np.eye(topology.num_nodes, dtype=bool)]
  min_link = float(off_diagonal.min()) if off_diagonal.size else 0.0
  # Per remaining stage at least: hop in, forward, backward, hop back.
  per_stage_bound = min(((2 * min_link + forward[n] + backward[n])
                         for nodes in stage_nodes[1:] for n in nodes),
                        default=0.0)
  loss = forward[data_node] * topology.loss_multiplier
  # A stream's micro-batches each hold a slot on the data node for a whole
  # round trip, so with m slots it takes at least ceil(w / m) round trips;
  # and the data node alone computes w x (forward + loss + backward).
  waves = -(-stream_length // int(topology.memory[data_node]))
  data_node_work = stream_length * (forward[data_node] + loss
                                    + backward[data_node])
  order = itertools.count()
  expansions = 0
  best: PathPlan | None = None

  def bound(stages, nodes, fwd_end, back_time, penalty_sum):
    remaining = config.path_length - len(stages)
    if remaining == 0:
      turn = 2 * link[nodes[-1], data_node]
    else:
      turn = 2 * min_link
    round_trip = fwd_end + remaining * per_stage_bound + turn + loss + back_time
    return max(waves * round_trip, data_node_work) + penalty_sum

  first_fwd = earliest_start(0.0, forward[data_node],
                             windows.get(data_node, ()))
  start_state = ((0,), (data_node,), first_fwd + forward[data_node],
                 backward[data_node], penalty[data_node])
  heap = [(bound(*start_state), next(order), False, start_state)]
  dominance: dict = {}
  while heap:
    key, _, closed, state = heapq.heappop(heap)
    if closed:
      return dataclasses.replace(state, expansions=expansions)
    if best is not None and key >= best.cost:
      break
    expansions += 1
    if expansions > max_expansions:
      break
    stages, nodes, fwd_end, back_time, penalty_sum = state
    if len(stages) == config.path_length:
      tasks = plan_stream(topology, microbatch, stream_length, stages, nodes,
                          windows, holds_by_node)
      completion = max(task.end for task in tasks)
      plan = PathPlan(stages, nodes, tuple(tasks), completion,
                      completion + penalty_sum, 0)
      if best is None or plan.cost < best.cost:
        best = plan
      heapq.heappush(heap, (plan.cost, next(order), True, plan))
      continue
    for stage, _ in paths_lib.next_stages(stages, num_stages, config):
      for node in stage_nodes[stage]:
        ready = fwd_end + link[nodes[-1], node]
        start = earliest_start(ready, forward[node], windows.get(node, ()))
        child = (stages + (stage,), nodes + (node,), start + forward[node],
                 back_time + backward[node] + link[node, nodes[-1]],
                 penalty_sum + penalty[node])
        # A prefix with the same visited set, last node and swaps that is
        # no earlier, no cheaper behind and no less penalised is dominated.
        signature = (frozenset(child[0]), stage, node,
                     paths_lib.count_swaps(child[0]))
        seen = dominance.setdefault(signature, [])
        if any(f <= child[2] and b <= child[3] and p <= child[4]
               for f, b, p in seen):
          continue
        seen.append(child[2:])
        heapq.heappush(heap, (bound(*child), next(order), False, child))
  if best is None:
    return None
  return dataclasses.replace(best, expansions=expansions)
