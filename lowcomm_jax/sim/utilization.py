"""Compute utilization of one worker under DP, DiLoCo and Streaming DiLoCo.

Reproduces the simulator behind Streaming DiLoCo's Table 4 (arXiv 2501.18512,
docs/algorithms.md §1.3): how much WAN bandwidth each method needs so that the
accelerators spend a target fraction of the wall time computing.

The model (all workers are alike, so one worker's timeline is enough):

* **Compute.** A step of ``t`` seconds (``Workload``) is split evenly over the
  L layers and, per layer, evenly over forward, backward for activations and
  backward for weights (Kaplan: 2N, 2N and 2N FLOPs per token). Layer ``l``'s
  gradient (or outer gradient) is ready when its backward-for-weights ends,
  ``t/3 + (L − l)·2t/(3L)`` after the step starts: the last layer first.
* **Communication.** Each layer's tensor is its own ring all-reduce (M
  workers, ``network.ring_all_reduce_seconds``) that starts as soon as it is
  ready, so it overlaps the rest of the backward; all reductions queue FIFO on
  the worker's one link (``clock.run_timeline``). Embeddings and head are
  counted inside the layers (N/L parameters per layer). Every per-layer
  reduction pays the ring's 2(M−1)·ℓ latency; Table 4 is reproduced with
  ℓ = 0, since tens of ms per layer would keep data-parallel below 95% CU at
  any bandwidth.
* **Dependencies.** A reduction issued at step s is consumed at step
  s + 1 + τ: layer l's result is needed when that step's forward reaches layer
  l, ``l·t/(3L)`` after it starts (``clock.Transfer.needed_after_s``). τ = 0
  is blocking. Because the backward queues the top layer first and the
  forward needs layer 0 first, a whole-model reduction (DP, DiLoCo) still
  blocks the next step entirely; a strided fragment gains a little.
* **Methods** (``Method``): data-parallel reduces every layer every step;
  DiLoCo reduces every layer every H steps; Streaming DiLoCo reduces one
  fragment of 3 layers (strided: layers p, p+P, p+2P, …; P = L/3) per H/P
  steps, fragment p at steps ``r·H + ⌊(p+1)·H/P⌋ − 1`` (H/P need not be an
  integer); "+ overlap" uses τ = 1, as the paper's final method.
* **Wire formats.** Data-parallel sends bf16 gradients (16 bits per
  parameter), DiLoCo and Streaming bf16 outer gradients (16), the FP4 variant
  4-bit codes (4; block scales ignored). So FP4 divides the bits by 4 against
  the other columns, by 8 against fp32. Why bf16 rather than fp32: the
  paper's Table 1 counts ≈400× fewer bits for overlapped-FP4 Streaming than
  for DP at H = 100, which is H · 16 / 4; and fp32 would double the DiLoCo
  and Streaming columns of Table 4, far from the paper's values.
* **Compute utilization** CU = compute time / wall time, measured in steady
  state: over rounds 1..R−1 of H steps (round 0 is warm-up), from the start of
  step H to the start of step R·H.

``required_bandwidth`` inverts CU(B) by bisection on log B; CU is
non-decreasing in B.

**How the papers report bandwidths.** Every value of Streaming DiLoCo's
Table 4 and of the scaling-law paper's Table 6 (arXiv 2503.09799) is a point
of ``numpy.logspace(-1, 3, 50)`` Gbit/s (consecutive points differ by
×1.207): each paper reports the smallest grid bandwidth whose CU reaches the
target, so its true value lies in (value / 1.207, value]. ``snap_to_grid``
puts ours on the same grid and ``grid_error`` compares the two; an unsnapped
comparison is biased (ours is exact, the paper's is rounded up by up to 21%).

**The two papers' configurations** (``PaperSetting``) are the same model with
the same assumptions: M = 2, bf16 gradients and outer gradients, no latency,
per-layer reductions overlapped with the backward, blocking DiLoCo. Neither
paper's text at hand gives M, the wire format or the layer count of the
scaling-law simulation; ``STREAMING_DILOCO_SETTING`` and
``SCALING_LAWS_SETTING`` name them so that a difference found later is one
field, not a second simulator. What the tables imply that this model lacks is
written in docs/simulator.md ("Where the model and the papers part").
"""

from __future__ import annotations

import dataclasses
import math

from lowcomm_jax import checks
from lowcomm_jax.sim import clock, network as network_lib

__all__ = [
    "ModelShape", "Workload", "Method", "data_parallel", "diloco", "streaming",
    "table4_methods", "PAPER_WORKLOADS", "PAPER_TABLE4", "simulate_method",
    "compute_utilization", "required_bandwidth", "utilization_curve",
    "reproduce_table4", "PAPER_GRID_GBIT", "snap_to_grid", "grid_error",
    "PaperSetting", "STREAMING_DILOCO_SETTING", "SCALING_LAWS_SETTING",
    "TABLE6_WORKLOADS", "TABLE6_CU", "PAPER_TABLE6", "table6_method",
    "reproduce_table6",
]


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What the simulator needs to know about a model.

  Attributes:
    num_layers: L, transformer blocks.
    num_params: N, parameters exchanged by a full sync.
    flops_per_token: training FLOPs per token; ``None`` means Kaplan's 6·N.
  """

  num_layers: int
  num_params: float
  flops_per_token: float | None = None

  def __post_init__(self):
    if int(self.num_layers) != self.num_layers or self.num_layers < 1:
      raise ValueError(f"num_layers: must be an integer >= 1, got {self.num_layers}")
    if not self.num_params > 0:
      raise ValueError(f"num_params: must be > 0, got {self.num_params}")

  @property
  def training_flops_per_token(self) -> float:
    if self.flops_per_token is not None:
      return self.flops_per_token
    return 6.0 * self.num_params


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model and the pure-compute time of one inner step on one worker.

  Attributes:
    model: the ``ModelShape``.
    step_seconds: t, seconds of one step with no communication.
  """

  model: ModelShape
  step_seconds: float

  def __post_init__(self):
    if not self.step_seconds > 0:
      raise ValueError(f"step_seconds: must be > 0, got {self.step_seconds}")

  @classmethod
  def from_flops(cls, model: ModelShape, tokens_per_step: float,
                 peak_flops_per_s: float, mfu: float = 0.6) -> "Workload":
    """t = tokens per step · FLOPs per token / (peak FLOP/s · MFU).

    Args:
      model: the model.
      tokens_per_step: tokens one worker processes per inner step.
      peak_flops_per_s: the worker's peak FLOP/s (all its accelerators).
      mfu: model FLOPs utilization; 60% as in the paper.
    """
    if not 0 < mfu <= 1:
      raise ValueError(f"mfu: must be in (0, 1], got {mfu}")
    flops = tokens_per_step * model.training_flops_per_token
    return cls(model, flops / (peak_flops_per_s * mfu))


@dataclasses.dataclass(frozen=True)
class Method:
  """A synchronization scheme.

  Attributes:
    name: label for tables.
    sync_every: H, inner steps between two syncs of the same parameters.
    layers_per_fragment: layers per fragment (Streaming, 3 in the paper);
      ``None`` syncs the whole model at once (DP, DiLoCo).
    overlap_steps: τ, steps a sync may run before the worker waits for it.
    bits_per_param: bits on the wire per parameter.
  """

  name: str
  sync_every: int = 1
  layers_per_fragment: int | None = None
  overlap_steps: int = 0
  bits_per_param: float = 16.0

  def __post_init__(self):
    checks.sync_every(self.sync_every, "Method.sync_every")  # H/P need not be an integer here
    if self.layers_per_fragment is not None and self.layers_per_fragment < 1:
      raise ValueError("layers_per_fragment: must be None or >= 1, got "
                       f"{self.layers_per_fragment}")
    if self.overlap_steps < 0:
      raise ValueError(f"overlap_steps: must be >= 0, got {self.overlap_steps}")
    if not self.bits_per_param > 0:
      raise ValueError(f"bits_per_param: must be > 0, got {self.bits_per_param}")

  def num_fragments(self, num_layers: int) -> int:
    """P: ⌈L / layers per fragment⌉, or 1 for a whole-model sync."""
    if self.layers_per_fragment is None:
      return 1
    return math.ceil(num_layers / self.layers_per_fragment)


def data_parallel(bits_per_param: float = 16.0) -> Method:
  """All-reduce of every gradient at every step (bf16 by default)."""
  return Method("Data-Parallel", 1, None, 0, bits_per_param)


def diloco(sync_every: int = 100, bits_per_param: float = 16.0) -> Method:
  """DiLoCo: the whole outer gradient every H steps, blocking."""
  return Method("DiLoCo", sync_every, None, 0, bits_per_param)


def streaming(sync_every: int = 100, layers_per_fragment: int = 3,
              overlap_steps: int = 0, bits_per_param: float = 16.0,
              name: str | None = None) -> Method:
  """Streaming DiLoCo: one strided fragment every H/P steps, overlapped τ."""
  if name is None:
    name = "Streaming DiLoCo"
    if overlap_steps:
      name += f" + overlap τ={overlap_steps}"
    if bits_per_param != 16:
      name += f" + {bits_per_param:g}-bit"
  return Method(name, sync_every, layers_per_fragment, overlap_steps,
                bits_per_param)


def table4_methods(sync_every: int = 100) -> list[Method]:
  """The five columns of the paper's Table 4 (τ = 1 for the overlapped ones)."""
  return [
      data_parallel(),
      diloco(sync_every),
      streaming(sync_every, name="Streaming DiLoCo"),
      streaming(sync_every, overlap_steps=1, name="+ overlap"),
      streaming(sync_every, overlap_steps=1, bits_per_param=4,
                name="+ overlap + FP4"),
  ]


# The paper's three simulated models with its own layer counts and step times
# (Table 4, docs/algorithms.md §1.3). N is the model's label, as the first author's
# public bandwidth simulator takes it (N in billions). The step time is the
# paper's, which fixes the tokens per step: t·peak·MFU / (6N), e.g. 2^20
# tokens per step for the 1B at ≈1.05e17 FLOP/s of peak per worker (≈100
# H100s).
PAPER_WORKLOADS = {
    "1B": Workload(ModelShape(24, 1e9), 0.1),
    "10B": Workload(ModelShape(48, 1e10), 0.8),
    "100B": Workload(ModelShape(108, 1e11), 4.9),
}

# Table 4 of arXiv 2501.18512: Gbit/s for 95% CU, M = 2, H = 100; columns
# data-parallel, DiLoCo, Streaming, + overlap, + overlap + FP4.
PAPER_TABLE4 = {
    "1B": (222.3, 23.3, 16.0, 9.1, 2.0),
    "10B": (268.3, 33.9, 13.3, 6.2, 1.4),
    "100B": (390.7, 49.4, 11.0, 5.2, 1.1),
}


def _transfers(method: Method, workload: Workload, num_workers: int,
               network: network_lib.Network, num_steps: int,
               overlap_backward: bool,
               forward_dependency: bool) -> list[clock.Transfer]:
  """Prices every per-layer reduction of ``num_steps`` steps."""
  layers = workload.model.num_layers
  t = workload.step_seconds
  h = method.sync_every
  p_count = method.num_fragments(layers)
  layer_bytes = workload.model.num_params / layers * method.bits_per_param / 8
  layer_seconds = network_lib.ring_all_reduce_seconds(
      layer_bytes, num_workers, network)
  # Step (within a round) at which each fragment syncs, torchft-style offsets;
  # the last fragment syncs on the round's last step, as DiLoCo does.
  # With P > H several fragments share a step (never step -1).
  sync_step = [max(0, math.floor((p + 1) * h / p_count) - 1)
               for p in range(p_count)]
  transfers = []
  for s in range(num_steps):
    for p in range(p_count):
      if s % h != sync_step[p]:
        continue
      consumed = s + 1 + method.overlap_steps
      # Strided fragment p: layers p, p+P, ...; backward visits them from the
      # top, so the highest layer is ready (and queued) first.
      for layer in reversed(range(p, layers, p_count)):
        if overlap_backward:
          ready = t / 3 + (layers - layer) * 2 * t / (3 * layers)
          # The consumed step's forward reaches this layer after layer·t/(3L).
          needed = layer * t / (3 * layers) if forward_dependency else 0.0
        else:
          ready, needed = None, 0.0
        transfers.append(clock.Transfer(s, consumed, layer_seconds, ready, needed))
  return transfers


def simulate_method(method: Method, workload: Workload, num_workers: int,
                    network: "network_lib.Network | str", num_rounds: int = 3,
                    overlap_backward: bool = True,
                    forward_dependency: bool = True,
                    extra_steps: int = 0) -> clock.Timeline:
  """Timeline of ``num_rounds`` rounds of H steps (plus ``extra_steps``)."""
  net = network_lib.parse_network(network)
  if num_rounds < 2:
    raise ValueError(f"num_rounds: must be >= 2 (one is warm-up), got {num_rounds}")
  num_steps = num_rounds * method.sync_every + extra_steps
  transfers = _transfers(method, workload, num_workers, net, num_steps,
                         overlap_backward, forward_dependency)
  return clock.run_timeline(workload.step_seconds, transfers, num_steps)


def compute_utilization(method: Method, workload: Workload, num_workers: int,
                        network: "network_lib.Network | str",
                        num_rounds: int = 3,
                        overlap_backward: bool = True,
                        forward_dependency: bool = True) -> float:
  """Steady-state CU = compute time / wall time.

  Args:
    method: the scheme (``data_parallel()``, ``diloco()``, ``streaming()``).
    workload: model and step time.
    num_workers: M.
    network: bandwidth and latency of each worker's WAN link.
    num_rounds: rounds of H steps simulated; the first is warm-up.
    overlap_backward: start each layer's reduction when its gradient is ready
      (the paper's model). False waits for the end of the step's compute and
      blocks the consumed step's start, which makes DiLoCo's CU exactly
      H·t / (H·t + t_allreduce).
    forward_dependency: let the consumed step run its forward up to the
      first layer still in flight (per-layer waiting); False waits at the
      step's start, as ``clock.simulate_run`` does for real runs.

  Returns:
    CU in (0, 1].
  """
  h = method.sync_every
  # One extra step so that step R·H is a real step: its start waits only for
  # what it consumes, not for syncs still allowed to run τ steps longer.
  timeline = simulate_method(method, workload, num_workers, network,
                             num_rounds, overlap_backward, forward_dependency,
                             extra_steps=1)
  wall = timeline.step_start[num_rounds * h] - timeline.step_start[h]
  compute = (num_rounds - 1) * h * workload.step_seconds
  return min(1.0, compute / wall)


def required_bandwidth(method: Method, workload: Workload, num_workers: int,
                       target_cu: float, latency_s: float = 0.0,
                       rel_tol: float = 1e-4, low: float = 1e3,
                       high: float = 1e16, **kwargs) -> float:
  """Smallest bandwidth (bit/s) with CU ≥ ``target_cu``, by log bisection.

  Args:
    method, workload, num_workers: as for ``compute_utilization``.
    target_cu: the utilization to reach, in (0, 1).
    latency_s: ℓ of the link.
    rel_tol: stop when high / low < 1 + rel_tol.
    low, high: bracket in bit/s.
    **kwargs: passed to ``compute_utilization``.

  Returns:
    The bandwidth, or ``math.inf`` when even an infinite bandwidth falls
    short (latency alone costs too much).
  """
  if not 0 < target_cu < 1:
    raise ValueError(f"target_cu: must be in (0, 1), got {target_cu}")

  def cu(bandwidth):
    return compute_utilization(method, workload, num_workers,
                               network_lib.Network(bandwidth, latency_s),
                               **kwargs)

  if cu(math.inf) < target_cu:
    return math.inf
  if cu(low) >= target_cu:
    return low
  while cu(high) < target_cu:
    low, high = high, high * 1e3
  log_low, log_high = math.log(low), math.log(high)
  while log_high - log_low > math.log1p(rel_tol):
    mid = 0.5 * (log_low + log_high)
    if cu(math.exp(mid)) >= target_cu:
      log_high = mid
    else:
      log_low = mid
  return math.exp(log_high)


def utilization_curve(method: Method, workload: Workload, num_workers: int,
                      bandwidths_bits_per_s, latency_s: float = 0.0,
                      **kwargs) -> list[float]:
  """CU at each bandwidth of ``bandwidths_bits_per_s`` (for plots)."""
  return [compute_utilization(method, workload, num_workers,
                              network_lib.Network(b, latency_s), **kwargs)
          for b in bandwidths_bits_per_s]


def reproduce_table4(target_cu: float = 0.95, sync_every: int = 100,
                     num_workers: int = 2, latency_s: float = 0.0,
                     workloads: "dict[str, Workload] | None" = None
                     ) -> dict[str, list[float]]:
  """Bandwidth (Gbit/s) for ``target_cu`` per model and Table 4 column.

  The defaults are the paper's setting: 95% CU, H = 100, M = 2 workers and a
  latency-free link (a per-layer WAN latency of tens of ms would keep
  data-parallel below 95% at any bandwidth).
  """
  workloads = PAPER_WORKLOADS if workloads is None else workloads
  return {
      name: [required_bandwidth(m, w, num_workers, target_cu, latency_s) / 1e9
             for m in table4_methods(sync_every)]
      for name, w in workloads.items()
  }


# numpy.logspace(-1, 3, 50) in Gbit/s: the bandwidths both papers evaluate.
PAPER_GRID_GBIT = tuple(10.0 ** (-1 + 4 * k / 49) for k in range(50))


def snap_to_grid(gbit_per_s: float) -> float:
  """Smallest point of ``PAPER_GRID_GBIT`` at or above ``gbit_per_s``.

  Returns ``math.inf`` above the grid's top (the paper's "1000+").
  """
  for point in PAPER_GRID_GBIT:
    if point >= gbit_per_s * (1 - 1e-9):
      return point
  return math.inf


def grid_error(ours_gbit: float, paper_gbit: float) -> float:
  """Relative error of ``snap_to_grid(ours)`` against the paper's grid point.

  ``paper_gbit`` is the printed value (one decimal, e.g. 323.8 for
  323.75); ``math.inf`` stands for "1000+", which ours matches when it also
  lies above the grid (both count as the point one step above 1000). An
  error is 0 or at least one grid step (+20.7% or −17.1%).
  """
  ours = snap_to_grid(ours_gbit)
  step = 10.0 ** (4 / 49)
  # "1000+" (and ours above the grid) count as the point one step above 1000.
  ours = PAPER_GRID_GBIT[-1] * step if math.isinf(ours) else ours
  if math.isinf(paper_gbit):
    paper = PAPER_GRID_GBIT[-1] * step
  else:
    paper = min(PAPER_GRID_GBIT, key=lambda point: abs(point - paper_gbit))
  return ours / paper - 1


@dataclasses.dataclass(frozen=True)
class PaperSetting:
  """One paper's simulator as a configuration of this module's model.

  Attributes:
    name: the paper, for tables.
    num_workers: M, workers in the ring all-reduce.
    latency_s: ℓ of the link.
    bits_per_param: bits on the wire per parameter for data-parallel
      gradients and DiLoCo outer gradients (FP4 columns set their own).
  """

  name: str
  num_workers: int = 2
  latency_s: float = 0.0
  bits_per_param: float = 16.0


# Streaming DiLoCo (arXiv 2501.18512), Table 4: M = 2 (two workers), bf16
# (its Table 1 counts H·16/4 ≈ 400× fewer bits for FP4), no latency.
STREAMING_DILOCO_SETTING = PaperSetting("Streaming DiLoCo, Table 4")
# Scaling laws for DiLoCo (arXiv 2503.09799), Table 6: the same values; M,
# the wire format and the layer counts are not stated in the text at hand.
SCALING_LAWS_SETTING = PaperSetting("DiLoCo scaling laws, Table 6")

TABLE6_CU = (0.5, 0.8, 0.9, 0.95, 0.99)

# Table 6's models and step times (MFU 60%). Layers: 48 for the 10B (as in
# Table 4), 126 for Llama 3 405B and 61 for DeepSeek-V3 (their published
# shapes); N is the parameters exchanged (all 671B of DeepSeek-V3's experts).
TABLE6_WORKLOADS = {
    "10B": Workload(ModelShape(48, 10e9), 0.8),
    "Llama3-405B": Workload(ModelShape(126, 405e9), 26.0),
    "DeepSeek-V3-671B": Workload(ModelShape(61, 671e9), 20.0),
}

# Table 6 of arXiv 2503.09799: Gbit/s for 50/80/90/95/99% CU, keyed by
# (model, H); H = 1 is data-parallel. math.inf is the paper's "1000+".
PAPER_TABLE6 = {
    ("10B", 1): (104.8, 184.2, 222.3, 222.3, 390.7),
    ("10B", 10): (16.0, 49.4, 86.8, 152.6, 222.3),
    ("10B", 50): (3.0, 11.0, 23.3, 41.0, 126.5),
    ("10B", 100): (1.4, 6.2, 13.3, 23.3, 86.8),
    ("10B", 300): (0.5, 2.0, 4.3, 9.1, 41.0),
    ("Llama3-405B", 1): (126.5, 222.3, 268.3, 323.8, 323.8),
    ("Llama3-405B", 100): (2.0, 7.5, 16.0, 33.9, 126.5),
    ("DeepSeek-V3-671B", 1): (323.8, 569.0, 686.6, 686.6, math.inf),
    ("DeepSeek-V3-671B", 100): (4.3, 16.0, 41.0, 72.0, 268.3),
}


def table6_method(sync_every: int, setting: PaperSetting = SCALING_LAWS_SETTING
                  ) -> Method:
  """Data-parallel for H = 1, blocking DiLoCo otherwise."""
  if sync_every == 1:
    return data_parallel(setting.bits_per_param)
  return diloco(sync_every, setting.bits_per_param)


def reproduce_table6(setting: PaperSetting = SCALING_LAWS_SETTING,
                     rows=None, targets=TABLE6_CU
                     ) -> dict[tuple[str, int], list[float]]:
  """Bandwidth (Gbit/s, unsnapped) per Table 6 row and CU target.

  Args:
    setting: the configuration (M, latency, bits).
    rows: ``(model, H)`` keys of ``PAPER_TABLE6`` to compute; all by default.
    targets: the CU targets.
  """
  rows = list(PAPER_TABLE6) if rows is None else rows
  return {
      (model, h): [required_bandwidth(
          table6_method(h, setting), TABLE6_WORKLOADS[model],
          setting.num_workers, c, setting.latency_s) / 1e9 for c in targets]
      for model, h in rows
  }
