"""Routes through a (stage × replica) pipeline grid: fixed, full-pipeline, SkipPipe and NoLoCo's
random routing.

A route is the list of devices one micro-batch visits: a stage id and the replica of that stage
serving it, starting at stage 0 on its own data-holding replica (its *origin*). The backward pass
retraces the route in reverse, and the loss is computed back on the origin (as in SkipPipe, where
the stage-0 node holds the embedding and the head; NoLoCo's code computes it on the last stage
instead, which moves one hop but not a single number of the gradient).

NoLoCo's random routing (docs/algorithms.md §2.2): micro-batches go in *slots*; in slot k every
replica of stage 0 starts one micro-batch, and at the boundary s → s+1 the replica i of stage s
sends to replica π_{k,s}[i] of stage s+1, where π_{k,s} = Perm_R(seed, k·S + s) is drawn from a seed
every device shares. Each π is a permutation, so every replica of every stage takes exactly one
micro-batch per slot. At evaluation routing is fixed: replica i → replica i.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


class Route(NamedTuple):
  """One micro-batch's way through the grid.

  stages: the stage ids visited, in order; stages[0] == 0.
  replicas: the replica serving each visited stage; replicas[0] is the origin (its data holder).
  """

  stages: tuple[int, ...]
  replicas: tuple[int, ...]

  @property
  def origin(self) -> int:
    return self.replicas[0]


def boundary_permutation(seed: int, slot: int, boundary: int, num_stages: int,
                         num_replicas: int) -> np.ndarray:
  """π_{k,s}: int[R], replica i of stage s sends slot k's micro-batch to replica π[i] of stage s+1.

  Drawn from (seed, k·S + s) as the reference draws Perm(seed = k·S + s); the same on every device.
  """
  rng = np.random.default_rng([int(seed), int(slot) * int(num_stages) + int(boundary)])
  return rng.permutation(int(num_replicas))


def random_replica_table(num_slots: int, num_stages: int, num_replicas: int, seed: int,
                         first_slot: int = 0) -> np.ndarray:
  """int[K, S, R]: the replica at stage s of the micro-batch started by replica r in slot k.

  Row s = 0 is the identity (every replica starts its own micro-batch); row s+1 is π_{k,s} applied
  to row s. `first_slot` offsets the slot counter k (a global count of slots, as in the reference).
  """
  _check_positive(num_slots=num_slots, num_stages=num_stages, num_replicas=num_replicas)
  table = np.zeros((num_slots, num_stages, num_replicas), np.int64)
  for k in range(num_slots):
    table[k, 0] = np.arange(num_replicas)
    for s in range(num_stages - 1):
      table[k, s + 1] = boundary_permutation(seed, first_slot + k, s, num_stages, num_replicas)[
        table[k, s]
      ]
  return table


def fixed_replica_table(num_slots: int, num_stages: int, num_replicas: int) -> np.ndarray:
  """int[K, S, R]: evaluation routing, replica r → replica r at every stage."""
  _check_positive(num_slots=num_slots, num_stages=num_stages, num_replicas=num_replicas)
  return np.broadcast_to(np.arange(num_replicas), (num_slots, num_stages, num_replicas)).copy()


def routes_from_replica_table(table_KxSxR: np.ndarray) -> list[Route]:
  """Full-depth routes (every stage in order), micro-batch m = k·R + r: slot-major."""
  table = np.asarray(table_KxSxR)
  num_slots, num_stages, num_replicas = table.shape
  return [Route(tuple(range(num_stages)), tuple(int(x) for x in table[k, :, r]))
          for k in range(num_slots) for r in range(num_replicas)]


def random_routes(num_slots: int, num_stages: int, num_replicas: int, seed: int,
                  first_slot: int = 0) -> list[Route]:
  """NoLoCo's random routing of K slots × R micro-batches (micro-batch m = k·R + r)."""
  return routes_from_replica_table(
      random_replica_table(num_slots, num_stages, num_replicas, seed, first_slot))


def full_pipeline_routes(num_microbatches_per_replica: int, num_stages: int,
                         num_replicas: int) -> list[Route]:
  """R independent full pipelines (fixed routing): every micro-batch through every stage in
  order."""
  return routes_from_replica_table(
      fixed_replica_table(num_microbatches_per_replica, num_stages, num_replicas))


def routes_from_skippipe(schedule, placement: Sequence[Sequence[int]]) -> list[Route]:
  """SkipPipe paths (`skippipe.Schedule`) on a grid placement (node ids per stage, R per stage).

  Replica r of stage s is node placement[s][r].
  """
  where = {}
  for s, nodes in enumerate(placement):
    for r, node in enumerate(nodes):
      where[int(node)] = (s, r)
  sizes = {len(nodes) for nodes in placement}
  if len(sizes) != 1:
    raise ValueError(f"placement: a (stage × replica) grid needs the same number of nodes per "
                     f"stage, got {[len(n) for n in placement]}")
  routes = []
  for path in getattr(schedule, "paths", schedule):
    for stage, node in zip(path.stages, path.nodes):
      if where.get(int(node), (None,))[0] != stage:
        raise ValueError(f"schedule: micro-batch {path.microbatch} runs stage {stage} on "
                         f"node {node}, which the placement does not give to stage {stage}")
    routes.append(Route(tuple(int(s) for s in path.stages),
                        tuple(where[int(n)][1] for n in path.nodes)))
  return routes


def _check_positive(**sizes) -> None:
  for name, value in sizes.items():
    if int(value) < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
