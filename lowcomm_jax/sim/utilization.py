"""Compute utilization of one worker under DP, DiLoCo and Streaming DiLoCo.

Rebuilds the simulator of Streaming DiLoCo (arXiv 2501.18512, §3.1, Table 4,
docs/algorithms.md §1.3), the one the DiLoCo scaling-law paper (arXiv
2503.09799, Table 6) also ran: how much WAN bandwidth each method needs so
that the accelerators spend a target fraction of the wall time computing.
The papers' settings, their tables and how close this model comes are in
``paper_tables``.

The paper describes its simulator as a DAG whose nodes are, per layer, the
forward, the backward w.r.t. activations, the backward w.r.t. parameters and
the reduction of that layer's (outer) gradient (§3.1, Fig. 3). This module
plays that DAG as one worker's timeline (all workers are alike):

* **Compute.** A step of ``t`` seconds (``Workload``) is split evenly over the
  L layers and, per layer, evenly over forward, backward for activations and
  backward for weights (Kaplan: 2N, 2N and 2N FLOPs per token). Layer ``l``'s
  gradient (or outer gradient) is ready when its backward-for-weights ends,
  ``t/3 + (L − l)·2t/(3L)`` after the step starts: the last layer first.
* **Communication.** Each layer's tensor is its own ring all-reduce (M
  workers, ``network.ring_all_reduce_seconds``) that starts as soon as it is
  ready, so it overlaps the rest of the backward. The worker has one link,
  which serves one reduction at a time and never interrupts one
  (``clock.run_timeline``). Embeddings and head are counted inside the
  layers (N/L parameters per layer). Every per-layer reduction pays the
  ring's 2(M−1)·ℓ latency; the papers' tables assume ℓ = 0, since tens of ms
  per layer would keep data-parallel below 95% CU at any bandwidth.
* **Link order** (``link_order``). When several reductions wait, the link
  serves the one needed soonest (``"deadline"``, the default): the next
  step's forward needs layer 0 first, so the first layers' reductions
  overtake the others and the next forward runs under the rest of the
  communication. This is the overlap the paper credits for the strided
  pattern's better utilization, "easier to overlap their communication with
  the first few layers' forward of the next step" (appendix, "Sequential vs
  strided patterns"; Fig. 14). Served in the order they are produced
  (``"fifo"``, top layer first), the lowest layer a step reduces always goes
  last, so the next forward cannot pass it before all of that step's
  communication is done; for data-parallel and DiLoCo, whose lowest layer is
  layer 0, it cannot start at all. The tables agree with the deadline order:
  link-bound, a data-parallel worker's link then idles only ``4t/(3L)`` a
  step (the forward of layer L−2, reduced last, and the forward and backward
  of layer L−1, reduced first), so 50% CU takes ``16N / (t·(2 − 4/(3L)))``
  bit/s, which is the printed value, on the papers' grid, of all six
  data-parallel 50% cells (Table 4: 1B, 10B, 100B; Table 6: 10B, Llama 3
  405B, DeepSeek-V3); with ``"fifo"`` all six are one grid step above.
* **Dependencies.** A reduction issued at step s is consumed at step
  s + 1 + τ: layer l's result is needed when that step's forward reaches layer
  l, ``l·t/(3L)`` after it starts (``clock.Transfer.needed_after_s``). τ = 0
  is blocking.
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
  state: R rounds of H steps, at least 32 steps and 3 rounds, the first
  quarter of the rounds (at least one) being warm-up. Near saturation
  (communication about as long as compute) a data-parallel timeline under
  the deadline order drifts through cycles tens to hundreds of steps long;
  the 24 steps measured are within 0.3% of CU of a 300-step measure.

``required_bandwidth`` inverts CU(B) by bisection on log B; CU is
non-decreasing in B (up to those cycles near saturation).
"""

from __future__ import annotations

import dataclasses
import math

from lowcomm_jax import checks
from lowcomm_jax.sim import clock, network as network_lib

__all__ = [
    "ModelShape", "Workload", "Method", "data_parallel", "diloco", "streaming",
    "LINK_ORDERS", "simulate_method", "compute_utilization",
    "required_bandwidth", "utilization_curve",
]

LINK_ORDERS = clock.LINK_ORDERS
# A steady-state measure spans at least this many steps (see the module doc).
_MIN_STEADY_STEPS = 32


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


def _num_rounds(sync_every: int, num_rounds: int | None) -> int:
  if num_rounds is None:
    return max(3, math.ceil(_MIN_STEADY_STEPS / sync_every))
  if num_rounds < 2:
    raise ValueError(f"num_rounds: must be >= 2 (one is warm-up), got {num_rounds}")
  return num_rounds


def simulate_method(method: Method, workload: Workload, num_workers: int,
                    network: "network_lib.Network | str",
                    num_rounds: int | None = None,
                    overlap_backward: bool = True,
                    forward_dependency: bool = True,
                    extra_steps: int = 0,
                    link_order: str = "deadline") -> clock.Timeline:
  """Timeline of ``num_rounds`` rounds of H steps (plus ``extra_steps``).

  ``num_rounds=None`` simulates at least 32 steps and 3 rounds;
  ``link_order`` is ``"deadline"`` or ``"fifo"`` (module docstring).
  """
  net = network_lib.parse_network(network)
  num_rounds = _num_rounds(method.sync_every, num_rounds)
  num_steps = num_rounds * method.sync_every + extra_steps
  transfers = _transfers(method, workload, num_workers, net, num_steps,
                         overlap_backward, forward_dependency)
  return clock.run_timeline(workload.step_seconds, transfers, num_steps,
                            order=link_order)


def compute_utilization(method: Method, workload: Workload, num_workers: int,
                        network: "network_lib.Network | str",
                        num_rounds: int | None = None,
                        overlap_backward: bool = True,
                        forward_dependency: bool = True,
                        link_order: str = "deadline") -> float:
  """Steady-state CU = compute time / wall time.

  Args:
    method: the scheme (``data_parallel()``, ``diloco()``, ``streaming()``).
    workload: model and step time.
    num_workers: M.
    network: bandwidth and latency of each worker's WAN link.
    num_rounds: rounds of H steps simulated; the first quarter (at least
      one) is warm-up. ``None``: at least 32 steps and 3 rounds.
    overlap_backward: start each layer's reduction when its gradient is ready
      (the paper's model). False waits for the end of the step's compute and
      blocks the consumed step's start, which makes DiLoCo's CU exactly
      H·t / (H·t + t_allreduce).
    forward_dependency: let the consumed step run its forward up to the
      first layer still in flight (per-layer waiting); False waits at the
      step's start, as ``clock.simulate_run`` does for real runs.
    link_order: ``"deadline"`` serves the waiting reduction needed soonest
      (the papers' tables), ``"fifo"`` the one produced first.

  Returns:
    CU in (0, 1].
  """
  h = method.sync_every
  num_rounds = _num_rounds(h, num_rounds)
  warm_up = max(1, num_rounds // 4)
  # One extra step so that step R·H is a real step: its start waits only for
  # what it consumes, not for syncs still allowed to run τ steps longer.
  timeline = simulate_method(method, workload, num_workers, network,
                             num_rounds, overlap_backward, forward_dependency,
                             extra_steps=1, link_order=link_order)
  wall = timeline.step_start[num_rounds * h] - timeline.step_start[warm_up * h]
  compute = (num_rounds - warm_up) * h * workload.step_seconds
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
