"""Event-driven simulator of one SkipPipe training iteration.

Given a topology, a placement and per-micro-batch paths, it plays the
iteration out in time: each micro-batch runs forward along its path, returns
to its stage-0 node for the loss, and runs backward along the reversed path;
every hop pays the link cost. A node computes one task at a time, so tasks
that reach a busy node wait (the collisions SkipPipe's TC2 avoids); waiting
tasks are served in arrival order (or losses and backwards first, with
`backward_first`). A micro-batch enters the pipeline only
when every node on its path has a free activation slot (TC1 memory), and
frees each slot when its backward on that node ends; reserving all slots at
once makes the simulation deadlock-free. After the last backward of a stage,
the stage's replicas all-reduce their gradients (data parallelism inside the
stage) with a ring over the stage's nodes.

`pipeline_time_s` (last backward done) is what the reference implementation's
simulator reports (its `run_simulation`); `iteration_time_s` adds the
all-reduce.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

import numpy as np

from lowcomm_jax.skippipe import paths as paths_lib
from lowcomm_jax.skippipe.topology import Topology

_ARRIVE, _DONE, _NODE_FREE, _RELEASE = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class SimulationConfig:
  """Options of the iteration simulator.

  Attributes:
    task_gap_s: a node stays busy this long after each task (the reference
      simulator uses 0.13 s for host-side work; 0 for an idealised node).
    include_allreduce: add the intra-stage data-parallel all-reduce.
    backward_first: a node serves waiting losses and backwards before
      waiting forwards (one-forward-one-backward order); False serves all in
      arrival order.
  """

  task_gap_s: float = 0.0
  include_allreduce: bool = True
  backward_first: bool = False


@dataclasses.dataclass(frozen=True)
class IterationResult:
  """What one simulated iteration took.

  Attributes:
    pipeline_time_s: when the last backward finished.
    iteration_time_s: when the last stage finished its all-reduce.
    allreduce_s: float[S], all-reduce duration per stage.
    stage_done_s: float[S], when each stage's all-reduce ended.
    node_busy_s: float[N], compute seconds per node.
    node_idle_s: float[N], pipeline_time_s - node_busy_s.
    microbatch_done_s: float[M], when each micro-batch's last backward ended.
    tasks: every executed task, in start order.
  """

  pipeline_time_s: float
  iteration_time_s: float
  allreduce_s: np.ndarray
  stage_done_s: np.ndarray
  node_busy_s: np.ndarray
  node_idle_s: np.ndarray
  microbatch_done_s: np.ndarray
  tasks: tuple[paths_lib.Task, ...]


def ring_allreduce_s(topology: Topology, nodes) -> float:
  """Seconds for a ring all-reduce of `dp_bytes` over `nodes`.

  2(n-1) steps, each moving dp_bytes / n over every ring link at once, so a
  step lasts as long as the slowest link (latency + transfer).
  """
  nodes = list(nodes)
  n = len(nodes)
  if n < 2 or topology.dp_bytes == 0:
    return 0.0
  chunk = topology.dp_bytes / n
  step = max(topology.latency_ms[a, b] / 1000.0
             + chunk / (topology.bandwidth_gibps[a, b] * 1024.0**3)
             for a, b in zip(nodes, nodes[1:] + nodes[:1]))
  return 2 * (n - 1) * float(step)


def simulate_iteration(topology: Topology, placement, schedule,
                       config: SimulationConfig = SimulationConfig()
                       ) -> IterationResult:
  """Plays one iteration of `schedule` out in time.

  Args:
    topology: the cluster and its cost model.
    placement: node ids per stage (list of int arrays).
    schedule: a `Schedule` (or a sequence of `MicrobatchPath`).
    config: simulator options.

  Returns:
    The `IterationResult`.
  """
  mb_paths = list(getattr(schedule, "paths", schedule))
  link = topology.link_cost_s
  task_lists = [paths_lib.task_sequence(p.stages, p.nodes, topology.forward_s,
                                        topology.loss_multiplier,
                                        topology.backward_multiplier)
                for p in mb_paths]
  num_nodes = topology.num_nodes
  held = np.zeros(num_nodes, np.int64)      # activation slots in use
  free_at = np.zeros(num_nodes)             # node busy until (incl. gap)
  running = np.zeros(num_nodes, bool)
  queues: list[list] = [[] for _ in range(num_nodes)]
  next_task = [0] * len(mb_paths)
  waiting = []                              # released, not yet admitted
  executed: list[paths_lib.Task] = []
  done_s = np.zeros(len(mb_paths))
  events: list = []
  order = itertools.count()

  def push(time, kind, payload):
    heapq.heappush(events, (time, kind, next(order), payload))

  for m, p in enumerate(mb_paths):
    push(float(p.release_s), _RELEASE, m)

  def admit(now):
    still = []
    for m in waiting:
      path_nodes = set(mb_paths[m].nodes)
      if all(held[n] < topology.memory[n] for n in path_nodes):
        for n in path_nodes:
          held[n] += 1
        push(now, _ARRIVE, m)
      else:
        still.append(m)
    waiting[:] = still

  while events:
    now = events[0][0]
    touched = set()
    while events and events[0][0] <= now:
      _, kind, _, payload = heapq.heappop(events)
      if kind == _RELEASE:
        waiting.append(payload)
        waiting.sort()
      elif kind == _ARRIVE:
        m = payload
        node, _, task_kind, _ = task_lists[m][next_task[m]]
        rank = int(not (config.backward_first and task_kind != paths_lib.FORWARD))
        heapq.heappush(queues[node], (rank, now, m))
        touched.add(node)
      elif kind == _NODE_FREE:
        touched.add(payload)
      elif kind == _DONE:
        m, node = payload
        running[node] = False
        _, _, task_kind, _ = task_lists[m][next_task[m]]
        if task_kind == paths_lib.BACKWARD:
          held[node] -= 1
        next_task[m] += 1
        if next_task[m] == len(task_lists[m]):
          done_s[m] = now
        else:
          next_node = task_lists[m][next_task[m]][0]
          push(now + link[node, next_node], _ARRIVE, m)
    admit(now)
    for node in sorted(touched):
      if running[node] or free_at[node] > now or not queues[node]:
        continue
      _, _, m = heapq.heappop(queues[node])
      _, stage, task_kind, duration = task_lists[m][next_task[m]]
      executed.append(paths_lib.Task(m, node, stage, task_kind, now,
                                     now + duration))
      running[node] = True
      free_at[node] = now + duration + config.task_gap_s
      push(now + duration, _DONE, (m, node))
      push(free_at[node], _NODE_FREE, node)

  if waiting:
    raise RuntimeError(f"micro-batches {waiting} were never admitted: a path "
                       f"node has memory 0.")
  return _summarise(topology, placement, executed, done_s, config)


def _summarise(topology, placement, executed, done_s, config):
  busy = np.zeros(topology.num_nodes)
  last_end = np.zeros(topology.num_nodes)
  for task in executed:
    busy[task.node] += task.end - task.start
    last_end[task.node] = max(last_end[task.node], task.end)
  pipeline = float(done_s.max()) if len(done_s) else 0.0
  allreduce = np.array([ring_allreduce_s(topology, nodes)
                        if config.include_allreduce else 0.0
                        for nodes in placement])
  stage_done = np.array([last_end[np.asarray(nodes)].max() + allreduce[s]
                         for s, nodes in enumerate(placement)])
  return IterationResult(
      pipeline_time_s=pipeline,
      iteration_time_s=float(max(pipeline, stage_done.max())),
      allreduce_s=allreduce, stage_done_s=stage_done, node_busy_s=busy,
      node_idle_s=pipeline - busy, microbatch_done_s=done_s,
      tasks=tuple(sorted(executed, key=lambda t: (t.start, t.node))))
