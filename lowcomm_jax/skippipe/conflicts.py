"""Conflicts between micro-batch agents' plans (SkipPipe's CBS, docs/algorithms.md §3.3).

The conflict-based search in `scheduler.py` branches on these, in the
paper's order: TC1 load (a node on more paths than memory x num_waves), then,
when collision-aware, TC1 memory (more activations held at once than a node
can keep) and TC2 collisions (two agents' tasks overlapping on one node),
the timing ones earliest first.
"""

from __future__ import annotations

import dataclasses

from lowcomm_jax.skippipe import paths as paths_lib


@dataclasses.dataclass(frozen=True)
class Conflict:
  """One conflict between agents, and the windows that would resolve it."""

  kind: str               # "load", "memory" or "overlap"
  node: int
  agents: tuple           # load: agents on the node; else (first, second)
  windows: tuple = ()     # per agent in `agents`: the window to forbid


def find_conflicts(plans, caps, memory, collision_aware: bool,
                   stream_length: int = 1) -> list[Conflict]:
  """Every conflict between agents' plans, load conflicts first.

  Agent a carries micro-batches a * stream_length ... (a + 1) *
  stream_length - 1; conflicts inside one agent's stream cannot occur
  (`search.plan_stream` avoids them).
  """
  conflicts = []
  visitors: dict[int, list[int]] = {}
  for agent, plan in enumerate(plans):
    for node in plan.nodes[1:]:
      visitors.setdefault(node, []).append(agent)
  for node, agents in sorted(visitors.items()):
    excess = -(-(len(agents) * stream_length - caps[node]) // stream_length)
    conflicts += [Conflict("load", node, tuple(agents))] * max(excess, 0)
  if not collision_aware:
    return conflicts
  temporal = []
  by_node: dict[int, list[paths_lib.Task]] = {}
  for plan in plans:
    for task in plan.tasks:
      by_node.setdefault(task.node, []).append(task)
  for node, tasks in by_node.items():
    tasks.sort(key=lambda t: (t.start, t.microbatch))
    for i, first in enumerate(tasks):       # sweep: overlapping pairs
      for second in tasks[i + 1:]:
        if second.start >= first.end:
          break
        later, earlier = (second.microbatch // stream_length,
                          first.microbatch // stream_length)
        if later != earlier:
          temporal.append((second.start, Conflict(
              "overlap", node, (later, earlier),
              ((first.start, first.end), (second.start, second.end)))))
    temporal += _memory_conflicts(node, tasks, int(memory[node]),
                                  stream_length)
  temporal.sort(key=lambda item: (item[0], item[1].kind, item[1].agents))
  return conflicts + [c for _, c in temporal]


def _memory_conflicts(node, tasks, memory, stream_length):
  """Instants where more micro-batches hold activations on `node` than
  `memory`; the newcomer's agent must wait for another agent's release."""
  hold: dict[int, list[float]] = {}
  for task in tasks:
    span = hold.setdefault(task.microbatch, [task.start, task.end])
    span[0], span[1] = min(span[0], task.start), max(span[1], task.end)
  spans = sorted((start, end, agent) for agent, (start, end) in hold.items())
  found, active = [], []
  for start, end, microbatch in spans:
    active = [(e, m) for e, m in active if e > start]
    agent = microbatch // stream_length
    others = [e for e, m in active if m // stream_length != agent]
    if len(active) >= memory and others:
      # The newcomer may not hold the node from its arrival until another
      # agent's first holder frees a slot.
      found.append((start, Conflict("memory", node, (agent,),
                                     ((start, min(others)),))))
    active.append((end, microbatch))
  return found
