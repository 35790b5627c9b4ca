"""Heterogeneous clusters for SkipPipe: nodes, links, stages and the cost model.

A `Topology` describes what the SkipPipe scheduler (Blagoev, Chen, Ersoy,
arXiv 2502.19913) plans against: nodes with a forward compute time per
micro-batch and an activation memory (micro-batches held at once), a latency
and bandwidth matrix between nodes, and how many nodes serve each pipeline
stage. Stage 0 holds the data: it computes the embedding, the first layers and
the loss, so every micro-batch starts and ends there.

Cost model (the reference implementation's, gensyn-ai/skippipe at commit
7f20d8a, `schedulers/communication_costs.py` and `create_schedule.py`):

* link cost between two nodes = latency_ms / 1000
  + bytes / (bandwidth_GiBps * 1024**3) + 0.35 s of measured per-hop overhead;
* forward compute of one micro-batch on one node = 0.055 s per layer per
  sample * layers per stage * samples per micro-batch;
* backward = 1.5 x forward, loss at the stage-0 node = 0.25 x forward.

The 12-region GCP figures (latency and bandwidth matrices, node placement,
constants and the simulated times the reference reports) are shipped as
`data/skippipe_gcp_topology.json`, a copy of the project's
`shared/data/skippipe_gcp_topology.json`, itself read from
github.com/gensyn-ai/skippipe. Its NL-London bandwidth (0.000237 GiB/s, about
1000x below every other European pair) looks like a typo, but the reference
runs used it, so `gcp_12_regions()` keeps it and `gcp_12_regions(
fix_nl_london=True)` replaces it with the Belgium-NL figure.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources

import numpy as np

# Reference constants (see the module docstring and the JSON's "constants").
FORWARD_S_PER_LAYER_PER_SAMPLE = 0.055
BACKWARD_MULTIPLIER = 1.5
LOSS_MULTIPLIER = 0.25
HOP_OVERHEAD_S = 0.35
MEMORY_MICROBATCHES = 3
ACTIVATION_BYTES_PER_SAMPLE_1_5B = 16777324
DP_BYTES_PER_STAGE_1_5B = 1346446748
# Two nodes in the same region: the reference scheduler's fallback.
SAME_REGION_LATENCY_MS = 1.0
SAME_REGION_BANDWIDTH_GIBPS = 2.0


@dataclasses.dataclass(frozen=True)
class Topology:
  """A cluster of pipeline nodes and the links between them.

  Attributes:
    node_names: a label per node (its region, plus an index).
    forward_s: float[N], forward compute time of one micro-batch through one
      stage on that node, in seconds.
    memory: int[N], micro-batches whose activations the node can hold at once
      (the paper's TC1 memory limit).
    latency_ms: float[N, N], one-way latency between nodes (diagonal unused).
    bandwidth_gibps: float[N, N], bandwidth in GiB/s as used in arithmetic.
    stage_sizes: nodes per stage; stage 0 is the data-holding stage.
    activation_bytes: bytes one micro-batch's activation (or its gradient)
      takes on the wire between stages.
    dp_bytes: bytes of one stage's gradients, all-reduced among the stage's
      replicas after the iteration (data parallelism inside a stage).
    hop_overhead_s: fixed seconds added to every inter-node transfer.
    backward_multiplier: backward time / forward time.
    loss_multiplier: loss time at the stage-0 node / its forward time.
    layers_per_stage: transformer layers each stage holds (to map stage
      paths to layer indices).
    regions: optional region names, one per distinct location (for plots).
    node_region: optional int[N], index into `regions` per node.
  """

  node_names: tuple[str, ...]
  forward_s: np.ndarray
  memory: np.ndarray
  latency_ms: np.ndarray
  bandwidth_gibps: np.ndarray
  stage_sizes: tuple[int, ...]
  activation_bytes: float
  dp_bytes: float
  hop_overhead_s: float = HOP_OVERHEAD_S
  backward_multiplier: float = BACKWARD_MULTIPLIER
  loss_multiplier: float = LOSS_MULTIPLIER
  layers_per_stage: int = 4
  regions: tuple[str, ...] = ()
  node_region: np.ndarray | None = None

  def __post_init__(self):
    n = len(self.node_names)
    if n == 0:
      raise ValueError("node_names: a topology needs at least one node, got 0.")
    for name, value in (("forward_s", self.forward_s), ("memory", self.memory)):
      if np.shape(value) != (n,):
        raise ValueError(f"{name}: expected shape ({n},) (one per node), "
                         f"got {np.shape(value)}.")
    for name, value in (("latency_ms", self.latency_ms),
                        ("bandwidth_gibps", self.bandwidth_gibps)):
      if np.shape(value) != (n, n):
        raise ValueError(f"{name}: expected shape ({n}, {n}), got "
                         f"{np.shape(value)}.")
    if not self.stage_sizes:
      raise ValueError("stage_sizes: at least one stage is needed, got ().")
    empty = [s for s, size in enumerate(self.stage_sizes) if size < 1]
    if empty:
      raise ValueError(f"stage_sizes: every stage needs at least 1 node; "
                       f"stage(s) {empty} are empty in {list(self.stage_sizes)}.")
    if sum(self.stage_sizes) != n:
      raise ValueError(f"stage_sizes: must sum to the number of nodes ({n}), "
                       f"got {list(self.stage_sizes)} (sum "
                       f"{sum(self.stage_sizes)}).")
    if np.any(np.asarray(self.forward_s) <= 0):
      raise ValueError("forward_s: every node's forward time must be > 0.")
    if np.any(np.asarray(self.memory) < 1):
      raise ValueError("memory: every node must hold at least 1 micro-batch.")
    off_diagonal = ~np.eye(n, dtype=bool)
    if np.any(np.asarray(self.bandwidth_gibps)[off_diagonal] <= 0):
      raise ValueError("bandwidth_gibps: off-diagonal bandwidths must be > 0.")

  @property
  def num_nodes(self) -> int:
    return len(self.node_names)

  @property
  def num_stages(self) -> int:
    return len(self.stage_sizes)

  @functools.cached_property
  def link_cost_s(self) -> np.ndarray:
    """float[N, N]: seconds to send one activation from node i to node j.

    latency / 1000 + bytes / (bandwidth * 1024**3) + overhead, zero on the
    diagonal (a node does not send to itself).
    """
    transfer = self.activation_bytes / (self.bandwidth_gibps * 1024.0**3)
    cost = self.latency_ms / 1000.0 + transfer + self.hop_overhead_s
    cost = np.array(cost, dtype=np.float64)
    np.fill_diagonal(cost, 0.0)
    return cost

  @property
  def backward_s(self) -> np.ndarray:
    return self.forward_s * self.backward_multiplier

  @property
  def loss_s(self) -> np.ndarray:
    return self.forward_s * self.loss_multiplier

  def with_costs(self, link_cost_s: np.ndarray, forward_s: np.ndarray
                 ) -> "Topology":
    """A copy whose link costs and forward times are the given arrays.

    Used for network-blind planning (uniform costs): latency carries the whole
    cost, bandwidth is made infinite-like and the overhead zero.
    """
    n = self.num_nodes
    huge_bandwidth = np.full((n, n), 1e30)
    return dataclasses.replace(
        self, latency_ms=np.asarray(link_cost_s, np.float64) * 1000.0,
        bandwidth_gibps=huge_bandwidth, hop_overhead_s=0.0,
        forward_s=np.asarray(forward_s, np.float64))


@functools.lru_cache(maxsize=1)
def reference_data() -> dict:
  """The reference implementation's figures, parsed from the shipped JSON."""
  text = resources.files(__package__).joinpath(
      "data", "skippipe_gcp_topology.json").read_text()
  return json.loads(text)


def _region_matrices(order: list[str], fix_nl_london: bool):
  """Latency and bandwidth between regions, re-indexed to `order`."""
  data = reference_data()
  regions = data["regions"]
  latency = np.array(data["latency_ms"], np.float64)
  bandwidth = np.array(data["bandwidth_GBps"], np.float64)
  if fix_nl_london:
    nl, london, belgium = (regions.index(r) for r in ("NL", "London", "Belgium"))
    # Every other European pair is 0.19-0.24 GiB/s; take Belgium-NL's figure.
    bandwidth[nl, london] = bandwidth[london, nl] = bandwidth[belgium, nl]
  index = [regions.index(r) for r in order]
  return latency[np.ix_(index, index)], bandwidth[np.ix_(index, index)]


def from_regions(order: list[str], num_nodes: int, stage_sizes, *,
                 layers_per_stage: int, samples_per_microbatch: int,
                 fix_nl_london: bool = False) -> Topology:
  """Nodes placed round-robin over GCP regions, as the reference does.

  Args:
    order: region names; node i lives in `order[i % len(order)]`.
    num_nodes: number of nodes.
    stage_sizes: nodes per stage (stage 0 holds the data).
    layers_per_stage: transformer layers per stage.
    samples_per_microbatch: sequences in one micro-batch.
    fix_nl_london: replace the reference's NL-London bandwidth typo.

  Returns:
    The topology with the reference's cost model and 1.5B-model byte counts.
  """
  latency_r, bandwidth_r = _region_matrices(order, fix_nl_london)
  node_region = np.arange(num_nodes) % len(order)
  latency = latency_r[np.ix_(node_region, node_region)].copy()
  bandwidth = bandwidth_r[np.ix_(node_region, node_region)].copy()
  # Distinct nodes in one region: the reference's fallback link (its matrix
  # diagonal holds exactly these values).
  same = node_region[:, None] == node_region[None, :]
  latency[same] = SAME_REGION_LATENCY_MS
  bandwidth[same] = SAME_REGION_BANDWIDTH_GIBPS
  compute = reference_data()["compute"]["per_region_forward_s_per_layer_per_sample"]
  forward = np.array([compute[order[r]] for r in node_region], np.float64)
  forward *= layers_per_stage * samples_per_microbatch
  names = tuple(f"{order[r]}-{i}" for i, r in enumerate(node_region))
  return Topology(
      node_names=names, forward_s=forward,
      memory=np.full(num_nodes, MEMORY_MICROBATCHES, np.int64),
      latency_ms=latency, bandwidth_gibps=bandwidth,
      stage_sizes=tuple(int(s) for s in stage_sizes),
      activation_bytes=float(ACTIVATION_BYTES_PER_SAMPLE_1_5B
                             * samples_per_microbatch),
      dp_bytes=float(DP_BYTES_PER_STAGE_1_5B),
      layers_per_stage=layers_per_stage, regions=tuple(order),
      node_region=node_region)


def gcp_12_regions(fix_nl_london: bool = False) -> Topology:
  """The reference's `schedule.json` setup: 20 nodes over 12 GCP regions.

  Stages [5, 3, 3, 3, 3, 3], 4 layers per stage, 2 samples per micro-batch
  (0.44 s forward per node), Belgium-first region order (reference commit
  e820bb4). Its link costs equal the JSON's `link_cost_s_schedule_json_setup`.
  """
  order = reference_data()["nodes"]["schedule_json_12_regions_20_nodes"]["order"]
  return from_regions(order, 20, (5, 3, 3, 3, 3, 3), layers_per_stage=4,
                      samples_per_microbatch=2, fix_nl_london=fix_nl_london)


def gcp_42_nodes(fix_nl_london: bool = False) -> Topology:
  """The reference's large experiment: 42 nodes over the same 12 regions.

  Stages [7, 5, 5, 5, 5, 5, 5, 5], 3 layers per stage, 1 sample per
  micro-batch (0.165 s forward), Australia-first order (commit b4c54b0).
  """
  order = reference_data()["nodes"]["commit_b4c54b0_42_nodes_12_regions"]["order"]
  return from_regions(order, 42, (7, 5, 5, 5, 5, 5, 5, 5), layers_per_stage=3,
                      samples_per_microbatch=1, fix_nl_london=fix_nl_london)


def reference_placement_12_regions() -> list[np.ndarray]:
  """The node-to-stage placement stored in the reference's schedule.json."""
  parts = reference_data()["nodes"]["schedule_json_12_regions_20_nodes"][
      "stage_partitions_node_ids"]
  return [np.array(p, np.int64) for p in parts]


def homogeneous(stage_sizes=(2, 2, 2, 2), *, forward_s: float = 0.2,
                link_cost_s: float = 0.5, memory: int = MEMORY_MICROBATCHES,
                layers_per_stage: int = 4) -> Topology:
  """Identical nodes and identical links: every link costs `link_cost_s`."""
  n = int(sum(stage_sizes))
  link = np.full((n, n), float(link_cost_s))
  base = Topology(
      node_names=tuple(f"node-{i}" for i in range(n)),
      forward_s=np.full(n, float(forward_s)),
      memory=np.full(n, int(memory), np.int64),
      latency_ms=np.zeros((n, n)), bandwidth_gibps=np.ones((n, n)),
      stage_sizes=tuple(int(s) for s in stage_sizes), activation_bytes=0.0,
      dp_bytes=0.0, layers_per_stage=layers_per_stage)
  return base.with_costs(link, base.forward_s)


def random_heterogeneous(seed: int, stage_sizes=(4, 3, 3, 3), *,
                         num_regions: int = 5, memory: int = MEMORY_MICROBATCHES,
                         layers_per_stage: int = 4) -> Topology:
  """A random geo-distributed cluster, reproducible from `seed`.

  Regions get random planar coordinates; latency grows with distance and
  bandwidth falls with it (same-region pairs: 1 ms, 2 GiB/s, as in the
  reference). Node speeds vary by up to 2x.
  """
  rng = np.random.default_rng(seed)
  n = int(sum(stage_sizes))
  position = rng.uniform(0.0, 1.0, size=(num_regions, 2))
  distance = np.linalg.norm(position[:, None] - position[None, :], axis=-1)
  latency_r = 1.0 + 150.0 * distance
  bandwidth_r = 2.0 / (1.0 + 60.0 * distance) * rng.uniform(0.7, 1.3,
                                                            distance.shape)
  bandwidth_r = (bandwidth_r + bandwidth_r.T) / 2
  node_region = rng.integers(0, num_regions, size=n)
  latency = latency_r[np.ix_(node_region, node_region)]
  bandwidth = bandwidth_r[np.ix_(node_region, node_region)]
  same = node_region[:, None] == node_region[None, :]
  latency = np.where(same, SAME_REGION_LATENCY_MS, latency)
  bandwidth = np.where(same, SAME_REGION_BANDWIDTH_GIBPS, bandwidth)
  forward = FORWARD_S_PER_LAYER_PER_SAMPLE * layers_per_stage * 2
  forward = forward * rng.uniform(1.0, 2.0, size=n)
  return Topology(
      node_names=tuple(f"r{r}-{i}" for i, r in enumerate(node_region)),
      forward_s=forward, memory=np.full(n, int(memory), np.int64),
      latency_ms=latency, bandwidth_gibps=bandwidth,
      stage_sizes=tuple(int(s) for s in stage_sizes),
      activation_bytes=float(2 * ACTIVATION_BYTES_PER_SAMPLE_1_5B),
      dp_bytes=float(DP_BYTES_PER_STAGE_1_5B), layers_per_stage=layers_per_stage,
      regions=tuple(f"region-{r}" for r in range(num_regions)),
      node_region=node_region)


# The presets `skippipe.topology` may name: clusters built without arguments.
PRESETS = {"gcp_12_regions": gcp_12_regions, "gcp_42_nodes": gcp_42_nodes,
           "homogeneous": homogeneous}
