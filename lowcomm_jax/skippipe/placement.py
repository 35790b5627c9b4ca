"""Placement of nodes onto pipeline stages (SkipPipe step 1, after DT-FM).

SkipPipe (arXiv 2502.19913, docs/algorithms.md §3.3) first decides which
nodes serve which stage, with the stage sizes fixed. The reference runs the
genetic search GCMA of DT-FM (Yuan et al. 2022); here a seeded simulated
annealing over node swaps minimises the same kind of cost:

  cost = dp_weight * DP + 2 * PP

* DP, the data-parallel cost: the slowest link inside any stage, since each
  stage all-reduces its gradients among its replicas after the iteration.
* PP, the pipeline cost: a closed tour 0 -> 1 -> ... -> S-1 -> 0 over stages
  where each hop costs the bottleneck of the best one-to-one matching between
  the two stages' nodes (edge = link cost + sender's forward time), i.e. how
  fast the stages can pass activations pairwise.

With `dp_weight` = 1 this cost, evaluated on the reference's own placement,
gives 21.5903005, the `GCMAscore` stored in its schedule.json, so 1 is the
default. `reference_dp_weight` gives the reference's FACTOR (dp_bytes /
(activation bytes x micro-batches per data node)) for a search that weighs the
all-reduce traffic more.
"""

from __future__ import annotations

import math

import numpy as np

from lowcomm_jax.skippipe.topology import Topology


def _has_matching(allowed: np.ndarray, size: int) -> bool:
  """Whether the bipartite graph `allowed` has a matching of `size` edges."""
  match_right = [-1] * allowed.shape[1]

  def augment(left, seen):
    for right in np.flatnonzero(allowed[left]):
      if not seen[right]:
        seen[right] = True
        if match_right[right] < 0 or augment(match_right[right], seen):
          match_right[right] = left
          return True
    return False

  found = 0
  for left in range(allowed.shape[0]):
    if augment(left, [False] * allowed.shape[1]):
      found += 1
  return found >= size


def bottleneck_matching_cost(cost: np.ndarray) -> float:
  """Smallest t such that min(rows, cols) disjoint pairs all cost <= t."""
  size = min(cost.shape)
  values = np.unique(cost)
  low, high = 0, len(values) - 1
  while low < high:       # binary search over the distinct edge costs
    mid = (low + high) // 2
    if _has_matching(cost <= values[mid], size):
      high = mid
    else:
      low = mid + 1
  return float(values[low])


def reference_dp_weight(topology: Topology, microbatches_per_data_node: int = 6
                      ) -> float:
  if topology.activation_bytes == 0:
    return 1.0
  return topology.dp_bytes / (topology.activation_bytes
                              * microbatches_per_data_node)


def placement_cost(topology: Topology, placement, dp_weight: float) -> float:
  """dp_weight x (slowest intra-stage link) + 2 x (bottleneck stage tour)."""
  link = topology.link_cost_s
  dp = max((link[np.ix_(nodes, nodes)].max() for nodes in placement),
           default=0.0)
  pp = 0.0
  for s, nodes in enumerate(placement):
    nxt = placement[(s + 1) % len(placement)]
    if len(placement) == 1:
      break
    edge = link[np.ix_(nodes, nxt)] + topology.forward_s[nodes][:, None]
    pp += bottleneck_matching_cost(edge)
  return float(dp_weight * dp + 2.0 * pp)


def _split(order: np.ndarray, stage_sizes) -> list[np.ndarray]:
  bounds = np.cumsum((0,) + tuple(stage_sizes))
  return [order[bounds[s]:bounds[s + 1]].copy()
          for s in range(len(stage_sizes))]


def order_for_pipelines(topology: Topology, placement) -> list[np.ndarray]:
  """Orders each stage's nodes so node j of every stage forms pipeline j.

  Stages 1..S-1 are chained by successive minimum-cost one-to-one matchings
  (the matched nodes first); then each chain gets the stage-0 node that
  minimises its round trip (hop into stage 1 plus the return from stage
  S-1 for the loss). The full-pipeline baseline (DT-FM) runs its
  micro-batches down these chains.
  """
  # imported here, not with the module: scipy.optimize takes about half a second to import, and
  # every config check imports this package
  from scipy.optimize import linear_sum_assignment  # pylint: disable=g-import-not-at-top
  link = topology.link_cost_s
  placement = [np.asarray(nodes, np.int64) for nodes in placement]
  if len(placement) == 1:
    return [placement[0].copy()]

  def matched_first(prev, nodes):
    rows, cols = linear_sum_assignment(link[np.ix_(prev, nodes)])
    chosen = cols[np.argsort(rows)]
    rest = [c for c in range(len(nodes)) if c not in set(chosen.tolist())]
    return nodes[np.concatenate([chosen, rest]).astype(np.int64)]

  ordered = [placement[1].copy()]
  for nodes in placement[2:]:
    ordered.append(matched_first(ordered[-1], nodes))
  heads, tails = ordered[0], ordered[-1]
  width = min(len(heads), len(tails))
  data = placement[0]
  round_trip = (link[np.ix_(data, heads[:width])]
                + link[np.ix_(tails[:width], data)].T)
  rows, cols = linear_sum_assignment(round_trip.T)
  chosen = cols[np.argsort(rows)]
  rest = [c for c in range(len(data)) if c not in set(chosen.tolist())]
  return [data[np.concatenate([chosen, rest]).astype(np.int64)]] + ordered


def optimize_placement(topology: Topology, *, seed: int = 0,
                       iterations: int = 3000, dp_weight: float = 1.0
                       ) -> list[np.ndarray]:
  """Seeded simulated annealing over node-to-stage placements.

  Moves: swap two nodes in different stages, or swap two whole stage groups
  of equal size (reorders the stage tour). Deterministic for a given seed.

  Args:
    topology: the cluster; its `stage_sizes` are kept.
    seed: random seed.
    iterations: annealing steps.
    dp_weight: weight of the data-parallel term.

  Returns:
    Node ids per stage, ordered for full pipelines (`order_for_pipelines`).
  """
  if iterations < 0:
    raise ValueError(f"iterations: must be >= 0, got {iterations}.")
  rng = np.random.default_rng(seed)
  sizes = topology.stage_sizes
  stage_of = np.repeat(np.arange(len(sizes)), sizes)
  order = rng.permutation(topology.num_nodes)
  cost = placement_cost(topology, _split(order, sizes), dp_weight)
  best_order, best_cost = order.copy(), cost
  temperature0 = max(cost, 1e-9) * 0.05
  equal_groups = [(a, b) for a in range(1, len(sizes))
                  for b in range(a + 1, len(sizes)) if sizes[a] == sizes[b]]
  bounds = np.cumsum((0,) + tuple(sizes))
  for step in range(iterations):
    candidate = order.copy()
    if equal_groups and rng.random() < 0.1:
      a, b = equal_groups[rng.integers(len(equal_groups))]
      sa, sb = slice(bounds[a], bounds[a + 1]), slice(bounds[b], bounds[b + 1])
      candidate[sa], candidate[sb] = order[sb], order[sa]
    else:
      i, j = rng.integers(topology.num_nodes, size=2)
      if stage_of[i] == stage_of[j]:
        continue
      candidate[i], candidate[j] = order[j], order[i]
    new_cost = placement_cost(topology, _split(candidate, sizes), dp_weight)
    temperature = temperature0 * (1.0 - step / max(iterations, 1)) + 1e-9
    if (new_cost <= cost
        or rng.random() < math.exp((cost - new_cost) / temperature)):
      order, cost = candidate, new_cost
      if cost < best_cost:
        best_order, best_cost = order.copy(), cost
  return order_for_pipelines(topology, _split(best_order, sizes))
