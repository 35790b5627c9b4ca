"""An independent checker of SkipPipe's constraints (docs/algorithms.md §3.2).

It shares no logic with the scheduler: it re-derives every rule from the
paths and the timeline alone, so tests can hold the scheduler to it.

Convergence constraints (CC), per micro-batch:
  * cc_start: the path starts at stage 0 on a stage-0 (data) node, and every
    visited node serves the stage it is listed for;
  * cc_length: exactly `path_length` stages are visited;
  * cc_once: no stage is visited twice;
  * cc_order: each step goes above the furthest stage reached (by at most
    `max_forward_jump`) or back to the stage just below it (an adjacent
    swap), with at most `max_swaps` swaps;
  * cc_end (timeline): the loss runs on the data node and the backward pass
    visits the path's nodes in reverse, ending on the data node.
Throughput constraints (TC):
  * tc1_injection: each data node injects `microbatches_per_data_node`;
  * tc1_node_load / tc1_stage_load: a node is on at most memory x num_waves
    paths per iteration, a stage receives at most the sum of its nodes' caps;
  * tc1_memory (timeline): at no instant does a node hold more micro-batches'
    activations (from its forward to its backward there) than its memory;
  * tc2_collision (timeline): no two micro-batches' tasks overlap on a node;
  * timing (timeline): tasks last as the cost model says and each starts
    after the previous one of its micro-batch ended plus the link cost.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class Violation:
  constraint: str
  microbatch: int | None
  node: int | None
  detail: str


def _path_violations(path, stage_of_node, data_nodes, config, num_stages):
  found = []
  m, stages, nodes = path.microbatch, list(path.stages), list(path.nodes)

  def bad(name, detail, node=None):
    found.append(Violation(name, m, node, detail))

  if not stages or stages[0] != 0 or nodes[0] not in data_nodes:
    bad("cc_start", f"path {stages} on {nodes} does not start at stage 0 on "
        f"a data node")
  if len(nodes) != len(stages):
    bad("cc_start", f"{len(stages)} stages but {len(nodes)} nodes")
  for stage, node in zip(stages, nodes):
    if not 0 <= stage < num_stages or stage_of_node.get(node) != stage:
      bad("cc_start", f"node {node} does not serve stage {stage}", node)
  if len(stages) != config.path_length:
    bad("cc_length", f"visits {len(stages)} stages, needs "
        f"{config.path_length}")
  if len(set(stages)) != len(stages):
    bad("cc_once", f"stage repeated in {stages}")
  furthest, swaps = (stages[0] if stages else 0), 0
  for stage in stages[1:]:
    if stage > furthest:
      if stage - furthest > config.max_forward_jump:
        bad("cc_order", f"jump {furthest}->{stage} exceeds "
            f"{config.max_forward_jump}")
      furthest = stage
    elif stage == furthest - 1:
      swaps += 1
    else:
      bad("cc_order", f"step back to {stage} from furthest {furthest} is not "
          f"an adjacent swap")
  if swaps > config.max_swaps:
    bad("cc_order", f"{swaps} swaps, at most {config.max_swaps}")
  return found


def _timeline_violations(topology, schedule, tasks):
  found = []
  by_mb = collections.defaultdict(list)
  by_node = collections.defaultdict(list)
  for task in tasks:
    by_mb[task.microbatch].append(task)
    by_node[task.node].append(task)
  link = topology.link_cost_s
  for path in schedule.paths:
    own = sorted(by_mb.get(path.microbatch, []), key=lambda t: t.start)
    expected = ([(n, "F") for n in path.nodes] + [(path.nodes[0], "L")]
                + [(n, "B") for n in reversed(path.nodes)])
    if [(t.node, t.kind) for t in own] != expected:
      found.append(Violation("cc_end", path.microbatch, None,
                             f"tasks {[(t.node, t.kind) for t in own]} differ "
                             f"from forward-loss-backward {expected}"))
      continue
    scale = {"F": 1.0, "L": topology.loss_multiplier,
             "B": topology.backward_multiplier}
    for i, task in enumerate(own):
      duration = topology.forward_s[task.node] * scale[task.kind]
      if abs((task.end - task.start) - duration) > 1e-6:
        found.append(Violation("timing", path.microbatch, task.node,
                               f"{task.kind} lasts {task.end - task.start}, "
                               f"cost model says {duration}"))
      if i == 0:
        if task.start < path.release_s - 1e-6:
          found.append(Violation("timing", path.microbatch, task.node,
                                 "starts before its release"))
        continue
      before = own[i - 1]
      arrival = before.end + link[before.node, task.node]
      if task.start < arrival - 1e-6:
        found.append(Violation("timing", path.microbatch, task.node,
                               f"starts at {task.start:.3f} before its input "
                               f"arrives at {arrival:.3f}"))
  for node, node_tasks in by_node.items():
    node_tasks.sort(key=lambda t: t.start)
    for a, b in zip(node_tasks, node_tasks[1:]):
      if b.start < a.end - 1e-6 and a.microbatch != b.microbatch:
        found.append(Violation("tc2_collision", b.microbatch, node,
                               f"[{b.start:.3f}, {b.end:.3f}) overlaps "
                               f"micro-batch {a.microbatch}'s "
                               f"[{a.start:.3f}, {a.end:.3f})"))
    held = {}
    for task in node_tasks:
      low, high = held.get(task.microbatch, (np.inf, -np.inf))
      held[task.microbatch] = (min(low, task.start), max(high, task.end))
    # Sweep: releases before arrivals at the same instant.
    points = sorted([(lo, 1, m) for m, (lo, hi) in held.items()]
                    + [(hi - _EPS, -1, m) for m, (lo, hi) in held.items()])
    count = 0
    for time_s, change, m in points:
      count += change
      if count > topology.memory[node]:
        found.append(Violation("tc1_memory", m, node,
                               f"{count} micro-batches held at {time_s:.3f}, "
                               f"memory {topology.memory[node]}"))
  return found


def check_schedule(topology, placement, schedule, config, *,
                   tasks=None, check_load: bool = True) -> list[Violation]:
  """Every violated constraint of `schedule` (empty list: all satisfied).

  Args:
    topology: the cluster.
    placement: node ids per stage.
    schedule: the `Schedule` to check.
    config: the `SkipConfig` limits.
    tasks: a timeline to check (the planned one or a simulated one); None
      uses `schedule.planned_tasks`, an empty one skips the timeline checks.
    check_load: check the TC1 load caps (the full pipeline ignores them).

  Returns:
    The list of `Violation`s.
  """
  stage_of_node = {int(n): s for s, nodes in enumerate(placement)
                   for n in nodes}
  data_nodes = {int(n) for n in placement[0]}
  found = []
  for path in schedule.paths:
    found += _path_violations(path, stage_of_node, data_nodes, config,
                              len(placement))
  if check_load:
    injected = collections.Counter(p.nodes[0] for p in schedule.paths)
    for node in sorted(data_nodes):
      if injected[node] != config.microbatches_per_data_node:
        found.append(Violation("tc1_injection", None, node,
                               f"injects {injected[node]}, expected "
                               f"{config.microbatches_per_data_node}"))
    visits = collections.Counter(n for p in schedule.paths for n in p.nodes[1:])
    caps = np.asarray(topology.memory) * config.num_waves
    for node, count in sorted(visits.items()):
      if count > caps[node]:
        found.append(Violation("tc1_node_load", None, node,
                               f"{count} paths, cap {caps[node]}"))
    for s, nodes in enumerate(placement[1:], start=1):
      load = sum(visits[int(n)] for n in nodes)
      if load > caps[np.asarray(nodes)].sum():
        found.append(Violation("tc1_stage_load", None, None,
                               f"stage {s}: {load} visits, cap "
                               f"{caps[np.asarray(nodes)].sum()}"))
  timeline = schedule.planned_tasks if tasks is None else tasks
  if timeline:
    found += _timeline_violations(topology, schedule, timeline)
  return found
