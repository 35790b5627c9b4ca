"""SkipPipe's collision-aware path scheduler (docs/algorithms.md §3.3 steps 2 and 3).

Every micro-batch of an iteration is an *agent* in a multi-agent path-finding
problem. Each agent's path is found by the best-first search of `search.py`;
a conflict-based search (CBS, Sharon et al. 2015) over all agents then
removes the conflicts between them, in the paper's order of phases:

1. TC1 load: a node serving a non-data stage is on more than
   memory x num_waves paths (so its stage is over its load too). Branch by
   forbidding that node to one of the agents on it (the ones whose re-plan
   costs least).
2. TC1 memory: at some instant more micro-batches hold activations on a node
   than its memory. The latest arrival may only start on that node once the
   first holder has released its slot.
3. TC2 collisions: two agents' tasks overlap in time on one node. Branch:
   either the later agent avoids the earlier one's window or the reverse.

Phases 2 and 3 run only when `collision_aware` is set; without them this is
the paper's "SkipPipe without TC2". An agent may carry a stream of several
micro-batches down one path (`SkipConfig.paths_per_data_node`; the
reference plans one path per data node).

Roots: for a few agent orders (slowest-alone first, wave order, seeded
shuffles) the agents are planned one after another, each avoiding nodes the
earlier ones filled (a conflict avoidance table) and, when collision-aware,
waiting for their tasks and memory (prioritized planning). The constraint
tree then orders its nodes by phase: nodes with only timing conflicts are
dived into greedily (fewest conflicts, then makespan: GCBS), the others
best-first by makespan, so cheap load-feasible assignments come first.
Every conflict-free solution is compacted (waits that stale constraints
left are removed, keeping each node's order) and scored with the iteration
simulator. The search stops after `max_solutions` solutions, when one beats
the first by `early_stop_ratio` (the reference's 0.88), or when the budget
ends, in which case the best partial solution is finished by always
constraining one agent per conflict. When collision-aware, the
load-balanced paths timed by simply waiting on collisions in arrival order
(the simulator's timeline: collision-free and within memory by
construction) are scored too as a warm start, and the fastest candidate is
returned; `stats["chosen"]` names which kind won.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time

import numpy as np

from lowcomm_jax.skippipe import paths as paths_lib, search, simulator
from lowcomm_jax.skippipe.conflicts import find_conflicts
from lowcomm_jax.skippipe.inputs import check_inputs, load_caps
from lowcomm_jax.skippipe.topology import Topology

# Extra cost (seconds-equivalent) of visiting a node other agents have filled.
_FULL_NODE_PENALTY = 1000.0


@dataclasses.dataclass(frozen=True)
class SearchBudget:
  """Limits of the conflict-based search.

  Attributes:
    max_cbs_nodes: constraint-tree nodes expanded before finishing greedily.
    max_solutions: conflict-free solutions to collect and score.
    early_stop_ratio: stop once a solution's simulated time is below this
      fraction of the first solution's.
    max_path_expansions: budget of each single-path search.
    load_branching: children per load conflict.
    max_repairs: conflicts the greedy finish may resolve.
    root_orderings: agent orders tried for the root plans (the first plans
      the agents whose fastest path is slowest first, the second in wave
      order, the rest are seeded shuffles); each root starts its own branch
      of the constraint tree.
    seed: seed of those shuffles.
  """

  max_cbs_nodes: int = 400
  max_solutions: int = 4
  early_stop_ratio: float = 0.88
  max_path_expansions: int = 20_000
  load_branching: int = 2
  max_repairs: int = 3000
  root_orderings: int = 8
  seed: int = 0


def _agents(placement, config):
  """(agent id, data node) in wave order: agent j*D + i is data node i's j-th
  path; it carries micro-batches agent * stream_length onwards."""
  data_nodes = [int(n) for n in placement[0]]
  return [(j * len(data_nodes) + i, d)
          for j in range(config.paths_per_data_node)
          for i, d in enumerate(data_nodes)]


class _Planner:
  """Re-plans single agents under their constraints and the load table."""

  def __init__(self, topology, placement, config, caps, budget):
    self.topology, self.placement, self.config = topology, placement, config
    self.caps, self.budget = caps, budget
    self.data_node = dict(_agents(placement, config))
    self.path_searches = 0

  def plan(self, agent, constraints, plans, holds_by_node=None):
    stream = self.config.stream_length
    load = np.zeros(self.topology.num_nodes, np.int64)
    for other, plan in enumerate(plans):
      if other != agent and plan is not None:
        load[list(plan.nodes[1:])] += stream
    penalty = np.where(load + stream > self.caps, _FULL_NODE_PENALTY, 0.0)
    self.path_searches += 1
    return search.find_path(
        self.topology, self.placement, self.config, agent * stream,
        self.data_node[agent], stream_length=stream, constraints=constraints,
        holds_by_node=holds_by_node, node_penalty=penalty,
        max_expansions=self.budget.max_path_expansions)


def _root_orderings(planner, agents, constraints, budget):
  """Agent orders for the root plans: slowest-alone first, then shuffles."""
  alone = []
  for agent, _ in agents:
    plan = planner.plan(agent, constraints[agent], [None] * len(agents))
    if plan is None:
      raise ValueError(
          f"config: no path of path_length={planner.config.path_length} "
          f"satisfies the convergence constraints on "
          f"{planner.topology.num_stages} stages.")
    alone.append(plan.completion_s)
  orderings = [tuple(int(a) for a in np.argsort(alone, kind="stable")[::-1]),
               tuple(range(len(agents)))]   # wave order
  rng = np.random.default_rng(budget.seed)
  for _ in range(budget.root_orderings - 2):
    candidate = tuple(int(a) for a in rng.permutation(len(agents)))
    if candidate not in orderings:
      orderings.append(candidate)
  return orderings[:max(budget.root_orderings, 1)]


def _key(conflicts, score):
  """Constraint-tree order: the paper's phases.

  Nodes whose loads are within the caps but that still have timing
  conflicts come first and are dived into greedily (fewest conflicts, then
  makespan) until conflict-free; the others (load conflicts, or none at all:
  solutions) are explored best-first by makespan, so load-feasible stage
  assignments are met cheapest first.
  """
  if conflicts and not any(c.kind == "load" for c in conflicts):
    return (0, len(conflicts)) + score
  return (1,) + score + (len(conflicts),)


def _score(plans):
  ends = [plan.completion_s for plan in plans]
  return max(ends), sum(ends)


def _children(planner, conflict, constraints, plans, budget):
  """Constraint-tree children resolving `conflict` (best first)."""
  options = []
  if conflict.kind == "load":
    for agent in conflict.agents:
      options.append((agent, constraints[agent].forbid_node(conflict.node)))
  else:
    for agent, (low, high) in zip(conflict.agents, conflict.windows):
      options.append((agent, constraints[agent].forbid_window(
          conflict.node, low, high)))
  children = []
  for agent, agent_constraints in options:
    plan = planner.plan(agent, agent_constraints, plans)
    if plan is None:
      continue
    new_constraints = constraints[:agent] + (agent_constraints,) + constraints[
        agent + 1:]
    new_plans = plans[:agent] + (plan,) + plans[agent + 1:]
    children.append((_score(new_plans), new_constraints, new_plans))
  children.sort(key=lambda c: c[0])
  limit = budget.load_branching if conflict.kind == "load" else 2
  return children[:limit]


def skippipe_schedule(topology: Topology, placement,
                      config: paths_lib.SkipConfig = paths_lib.SkipConfig(), *,
                      collision_aware: bool = True,
                      budget: SearchBudget = SearchBudget(),
                      plan_topology: Topology | None = None,
                      score_config: simulator.SimulationConfig | None = None,
                      method: str | None = None) -> paths_lib.Schedule:
  """Plans every micro-batch's path for one iteration (SkipPipe).

  Args:
    topology: the cluster.
    placement: node ids per stage (stage 0 = data nodes).
    config: convergence and throughput limits.
    collision_aware: resolve TC1 memory and TC2 collisions in time (SkipPipe);
      False plans load-balanced paths only ("SkipPipe without TC2").
    budget: search limits.
    plan_topology: costs to plan on, if not `topology`'s (network-blind
      baselines plan on uniform costs).
    score_config: simulator options used to score candidate solutions
      (the all-reduce is never included: it does not depend on the paths).
    method: label stored in the schedule.

  Returns:
    A `Schedule` with one path per micro-batch (release = planned start of
    its first forward) and the planned task timeline.
  """
  started = time.perf_counter()
  placement = check_inputs(topology, placement, config)
  plan_topology = plan_topology or topology
  caps = load_caps(topology, placement, config)
  planner = _Planner(plan_topology, placement, config, caps, budget)
  agents = _agents(placement, config)
  constraints = tuple(search.AgentConstraints() for _ in agents)

  def conflicts_of(plans):
    return find_conflicts(plans, caps, topology.memory, collision_aware,
                          config.stream_length)

  def build_root(agent_order, temporal):
    plans: list = [None] * len(agents)
    root_constraints = list(constraints)
    holds: dict[int, list] = {}
    for agent in agent_order:
      # Each agent avoids nodes the agents before it filled and, when
      # `temporal`, waits for their tasks and their memory (prioritized
      # planning); the constraint tree then resolves what is left.
      if temporal:
        root_constraints[agent] = dataclasses.replace(
            root_constraints[agent], windows=tuple(
                (t.node, t.start, t.end) for other in plans
                if other is not None for t in other.tasks))
      plans[agent] = planner.plan(agent, root_constraints[agent], plans,
                                  holds if temporal else None)
      if temporal and plans[agent] is not None:
        by_microbatch = {}
        for task in plans[agent].tasks:
          by_microbatch.setdefault(task.microbatch, []).append(task)
        for own in by_microbatch.values():
          for node, span in search.holds_of(own).items():
            holds.setdefault(node, []).append(span)
    return tuple(root_constraints), tuple(plans)

  sim_config = dataclasses.replace(score_config or simulator.SimulationConfig(),
                                   include_allreduce=False)

  def simulate(plans):
    return simulator.simulate_iteration(
        plan_topology, placement, _to_schedule(plans, ""), sim_config)

  order = itertools.count()
  frontier, solutions = [], []
  orderings = _root_orderings(planner, agents, constraints, budget)
  for agent_order in orderings:
    root_constraints, plans = build_root(agent_order, collision_aware)
    root_conflicts = conflicts_of(plans)
    heapq.heappush(frontier, (_key(root_conflicts, _score(plans)),
                              next(order), root_constraints, plans,
                              root_conflicts))
  if collision_aware:
    # Warm start: load-balanced paths that simply wait on collisions in
    # arrival order. Their simulated timeline is collision-free and within
    # memory by construction, so it is a valid solution of the full problem
    # that the constraint tree's solutions must beat.
    for agent_order in orderings:
      _, plans = build_root(agent_order, False)
      if find_conflicts(plans, caps, topology.memory, False,
                        config.stream_length):
        continue
      timed = _retime(plans, simulate(plans).tasks)
      solutions.append((simulate(timed).pipeline_time_s, next(order), timed,
                        "waiting"))
  warm = len(solutions)
  expanded, best_partial = 0, frontier[0]
  while frontier and expanded < budget.max_cbs_nodes:
    item = heapq.heappop(frontier)
    key, _, constraints, plans, conflicts = item
    if conflicts and len(conflicts) < len(best_partial[4]):
      best_partial = item
    if not conflicts:
      plans = _compact(plan_topology, plans)
      sim = simulate(plans)
      solutions.append((sim.pipeline_time_s, -1, plans, "cbs"))
      first = solutions[warm][0]
      if (len(solutions) - warm >= budget.max_solutions
          or sim.pipeline_time_s < budget.early_stop_ratio * first):
        break
      continue
    expanded += 1
    for score, child_constraints, child_plans in _children(
        planner, conflicts[0], constraints, plans, budget):
      child_conflicts = conflicts_of(child_plans)
      heapq.heappush(frontier, (_key(child_conflicts, score),
                                next(order),
                                child_constraints, child_plans,
                                child_conflicts))
  repairs = 0
  if len(solutions) == warm:           # finish greedily: later agent yields
    _, _, constraints, plans, conflicts = best_partial
    while conflicts and repairs < budget.max_repairs:
      children = _children(planner, conflicts[0], constraints, plans, budget)
      if not children:
        break
      _, constraints, plans = children[0]
      conflicts = conflicts_of(plans)
      repairs += 1
    if not conflicts_of(plans):
      plans = _compact(plan_topology, plans)
      solutions.append((simulate(plans).pipeline_time_s, next(order), plans,
                        "cbs_repaired"))
    elif not solutions:
      solutions.append((np.inf, 0, plans, "unresolved"))
  solutions.sort(key=lambda s: s[:2])
  best_plans = solutions[0][2]
  unresolved = conflicts_of(best_plans)
  if unresolved:
    raise RuntimeError(
        f"skippipe_schedule: {len(unresolved)} conflicts (first: "
        f"{unresolved[0].kind} on node {unresolved[0].node}) left after "
        f"{expanded} constraint-tree nodes and {repairs} repairs; raise "
        f"SearchBudget.max_cbs_nodes or max_repairs, or relax the config.")
  stats = dict(scheduler_s=time.perf_counter() - started,
               cbs_nodes_expanded=expanded, solutions=len(solutions),
               chosen=solutions[0][3], chosen_simulated_s=solutions[0][0],
               best_cbs_simulated_s=min((s[0] for s in solutions
                                         if s[3] != "waiting"),
                                        default=None),
               greedy_repairs=repairs, path_searches=planner.path_searches)
  label = method or ("skippipe" if collision_aware else "skippipe_no_tc2")
  return _to_schedule(best_plans, label, stats)


def _compact(topology, plans):
  """Removes waits the solution no longer needs, keeping each node's order.

  Constraints added against an agent's old windows stay in the tree after
  that agent moved, so a solution can wait for nothing. Re-timing every
  task as early as its micro-batch's previous task (plus the link) and the
  previous task in its node's planned order allow never starts a task later,
  and keeps the order of forwards and backwards on every node, hence the
  memory held at each step of it and the absence of overlaps.
  """
  link = topology.link_cost_s
  tasks = sorted((t for plan in plans for t in plan.tasks),
                 key=lambda t: (t.start, t.end))
  node_free, mb_ready, mb_node, new = {}, {}, {}, []
  for task in tasks:
    ready = 0.0
    if task.microbatch in mb_ready:
      ready = (mb_ready[task.microbatch]
               + link[mb_node[task.microbatch], task.node])
    start = max(ready, node_free.get(task.node, 0.0))
    end = start + (task.end - task.start)
    new.append(task._replace(start=start, end=end))
    node_free[task.node] = end
    mb_ready[task.microbatch], mb_node[task.microbatch] = end, task.node
  return _retime(plans, new)


def _retime(plans, tasks):
  """The same paths with the given (simulated) timeline as their plan."""
  by_microbatch = {}
  for task in tasks:
    by_microbatch.setdefault(task.microbatch, []).append(task)
  retimed = []
  for plan in plans:
    own = sorted((t for m in sorted({t.microbatch for t in plan.tasks})
                  for t in by_microbatch[m]), key=lambda t: t.start)
    retimed.append(dataclasses.replace(
        plan, tasks=tuple(own), completion_s=max(t.end for t in own)))
  return tuple(retimed)


def _to_schedule(plans, method, stats=None) -> paths_lib.Schedule:
  first_start = {}
  for plan in plans:
    for task in plan.tasks:
      first_start.setdefault(task.microbatch, task.start)
  paths = tuple(sorted((paths_lib.MicrobatchPath(
      microbatch=m, stages=plan.stages, nodes=plan.nodes,
      release_s=first_start[m]) for plan in plans
      for m in sorted({t.microbatch for t in plan.tasks})),
                       key=lambda p: p.microbatch))
  tasks = tuple(sorted((t for plan in plans for t in plan.tasks),
                       key=lambda t: (t.start, t.node)))
  return paths_lib.Schedule(paths=paths, method=method, planned_tasks=tasks,
                            stats=stats or {})
