"""The two papers' compute-utilization tables, and this simulator against them.

Streaming DiLoCo (arXiv 2501.18512) prints, in its Table 4, the Gbit/s each
method needs to reach 50/80/90/95/99% compute utilization (CU) for a 1B, a
10B and a 100B model. The DiLoCo scaling-law paper (arXiv 2503.09799) prints
the same for data-parallel and DiLoCo at H = 10…300 on a 10B model, Llama 3
405B and DeepSeek-V3 in its Table 6, which it "estimate[s] … using
[Douillard et al., 2025]'s simulator", i.e. Streaming DiLoCo's, with step
times from Kaplan's FLOP rule at 60% MFU (Table 6 caption, §5.1 "Compute
utilization"). Both tables therefore come from one simulator, the one
``utilization`` rebuilds. The closed form of the scaling-law paper's Appendix
A (an all-reduce of N parameters takes at least 2N/W·(1 − 1/R), added to the
compute time, no overlap) is that paper's idealized wall-clock model for its
Figures 6 and 12, not for Table 6: on Table 6's rows it needs 2.1 to 150
times the printed bandwidth (``appendix_a_bandwidth``).

**What the papers state, and what this module takes.**

* Table 4: 24/48/108 layers and 0.1/0.8/4.9 s per step ("based on each model
  scale flops profile, a reasonable amount of chips, and a MFU of 60%");
  H = 100; fragments of 3 layers, strided; τ = 1 for the overlapped columns;
  4-bit floats for FP4; M = 2 (§3.2: "We use 2 DiLoCo replicas").
* Table 6: 0.8/26/20 s per step; 48 layers for the 10B (the scaling-law
  paper's Table 3). Not printed, taken from the models' published shapes:
  126 layers for Llama 3 405B, 61 for DeepSeek-V3; not printed either, taken
  as for Table 4: M = 2 and bf16.
* N is the model's label; for DeepSeek-V3 all 671B parameters (every expert
  is synchronized, not only the 37B a token activates). 16 bits for
  gradients and outer gradients (Table 1 of 2501.18512 counts ≈400× fewer
  bits for FP4 at H = 100: H·16/4). The data-parallel 50% cells check N, the
  bits and M together: there a link-bound worker's link is busy nearly all
  the time, and all six such cells of the two tables are the grid point at
  or above ``16N / (t·(2 − 4/(3L)))`` (``utilization`` docstring); 37B for
  DeepSeek-V3, fp32 or M = 4 would put them two or more grid steps away.
* Links have no latency; the link serves the waiting reduction needed soonest
  (``utilization``, "Link order").

**How the papers report bandwidths.** Every value of both tables is a point
of ``numpy.logspace(-1, 3, 50)`` Gbit/s (consecutive points differ by
×1.207): each paper reports the smallest grid bandwidth whose CU reaches the
target, so its true value lies in (value / 1.207, value]. ``snap_to_grid``
puts ours on the same grid and ``grid_error`` compares the two: an error is 0
or at least a whole grid step (+20.7% or −17.1%), so "within 15%" on the
grid means "the same grid point". ``compare_table4`` and ``compare_table6``
give that and the unsnapped error of every cell.

**What one model cannot do.** The two papers print different values for the
same configuration: the 10B model at 0.8 s with 48 layers, data-parallel and
DiLoCo at H = 100, M = 2, bf16 (Table 4's 10B data-parallel and DiLoCo rows;
Table 6's 10B rows H = 1 and H = 100). They differ in 8 of those 10 cells, by
two grid steps for DiLoCo at 95% CU (33.9 against 23.3 Gbit/s), and no number
lies within 15% of both of those. A model that matches one table's cells on
that configuration misses the other's; docs/simulator.md lists the cells
this one misses.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from lowcomm_jax.sim import utilization as util

__all__ = [
    "TABLE_CU", "PAPER_GRID_GBIT", "snap_to_grid", "grid_error", "PaperSetting",
    "STREAMING_DILOCO_SETTING", "SCALING_LAWS_SETTING", "PAPER_WORKLOADS",
    "TABLE4_COLUMNS", "PAPER_TABLE4", "table4_methods", "reproduce_table4",
    "TABLE6_WORKLOADS", "PAPER_TABLE6", "table6_method", "reproduce_table6",
    "Cell", "compare_table4", "compare_table6", "count_within",
    "appendix_a_bandwidth",
]

# The CU targets of both tables.
TABLE_CU = (0.5, 0.8, 0.9, 0.95, 0.99)

# numpy.logspace(-1, 3, 50) in Gbit/s: the bandwidths both papers evaluate.
PAPER_GRID_GBIT = tuple(10.0 ** (-1 + 4 * k / 49) for k in range(50))
_GRID_STEP = 10.0 ** (4 / 49)


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
  # "1000+" (and ours above the grid) count as the point one step above 1000.
  ours = PAPER_GRID_GBIT[-1] * _GRID_STEP if math.isinf(ours) else ours
  if math.isinf(paper_gbit):
    paper = PAPER_GRID_GBIT[-1] * _GRID_STEP
  else:
    paper = min(PAPER_GRID_GBIT, key=lambda point: abs(point - paper_gbit))
  return ours / paper - 1


@dataclasses.dataclass(frozen=True)
class PaperSetting:
  """One paper's runs of the simulator as a configuration of ``utilization``.

  Attributes:
    name: the paper, for tables.
    num_workers: M, workers in the ring all-reduce.
    latency_s: ℓ of the link.
    bits_per_param: bits on the wire per parameter for data-parallel
      gradients and DiLoCo outer gradients (FP4 columns set their own).
    link_order: how the link picks among waiting reductions
      (``utilization.LINK_ORDERS``).
  """

  name: str
  num_workers: int = 2
  latency_s: float = 0.0
  bits_per_param: float = 16.0
  link_order: str = "deadline"

  def __post_init__(self):
    if self.link_order not in util.LINK_ORDERS:
      raise ValueError(f"link_order: must be one of {', '.join(util.LINK_ORDERS)}, "
                       f"got {self.link_order!r}")

  def required_gbit(self, method: util.Method, workload: util.Workload,
                    target_cu: float) -> float:
    """Gbit/s for ``target_cu`` under this setting."""
    return util.required_bandwidth(method, workload, self.num_workers, target_cu,
                                   self.latency_s, rel_tol=1e-3,
                                   link_order=self.link_order) / 1e9


# Streaming DiLoCo (arXiv 2501.18512), Table 4: M = 2 (§3.2), bf16 (its
# Table 1 counts H·16/4 ≈ 400× fewer bits for FP4), no latency.
STREAMING_DILOCO_SETTING = PaperSetting("Streaming DiLoCo, Table 4")
# Scaling laws for DiLoCo (arXiv 2503.09799), Table 6: Streaming DiLoCo's
# simulator (its caption); M and the wire format are not printed, so the
# same as Table 4.
SCALING_LAWS_SETTING = PaperSetting("DiLoCo scaling laws, Table 6")

# Table 4's three models with the paper's layer counts and step times. The
# step time fixes the tokens per step: t·peak·MFU / (6N), e.g. 2^20 tokens per
# step for the 1B at ≈1.05e17 FLOP/s of peak per worker (≈100 H100s).
PAPER_WORKLOADS = {
    "1B": util.Workload(util.ModelShape(24, 1e9), 0.1),
    "10B": util.Workload(util.ModelShape(48, 1e10), 0.8),
    "100B": util.Workload(util.ModelShape(108, 1e11), 4.9),
}

TABLE4_COLUMNS = ("Data-Parallel", "DiLoCo", "Streaming DiLoCo", "+ overlap",
                  "+ overlap + FP4")

# Table 4 of arXiv 2501.18512: Gbit/s for 50/80/90/95/99% CU, keyed by
# (model, column); H = 100, M = 2.
PAPER_TABLE4 = {
    ("1B", "Data-Parallel"): (86.8, 152.6, 184.2, 222.3, 569.0),
    ("1B", "DiLoCo"): (1.4, 6.2, 13.3, 23.3, 86.8),
    ("1B", "Streaming DiLoCo"): (1.4, 5.2, 9.1, 16.0, 28.1),
    ("1B", "+ overlap"): (1.4, 4.3, 6.2, 9.1, 11.0),
    ("1B", "+ overlap + FP4"): (0.4, 0.9, 1.7, 2.0, 3.0),
    ("10B", "Data-Parallel"): (104.8, 222.3, 222.3, 268.3, 471.5),
    ("10B", "DiLoCo"): (1.7, 7.5, 16.0, 33.9, 104.8),
    ("10B", "Streaming DiLoCo"): (1.7, 5.2, 9.1, 13.3, 19.3),
    ("10B", "+ overlap"): (1.7, 3.6, 5.2, 6.2, 7.5),
    ("10B", "+ overlap + FP4"): (0.4, 0.9, 1.4, 1.4, 1.7),
    ("100B", "Data-Parallel"): (184.2, 323.8, 390.7, 390.7, 471.5),
    ("100B", "DiLoCo"): (3.0, 11.0, 23.3, 49.4, 184.2),
    ("100B", "Streaming DiLoCo"): (2.4, 6.2, 9.1, 11.0, 19.3),
    ("100B", "+ overlap"): (1.7, 3.6, 4.3, 5.2, 5.2),
    ("100B", "+ overlap + FP4"): (0.5, 0.9, 1.1, 1.1, 1.4),
}


def table4_methods(sync_every: int = 100,
                   setting: PaperSetting = STREAMING_DILOCO_SETTING
                   ) -> list[util.Method]:
  """Table 4's five columns (τ = 1 for the overlapped ones, 4 bits for FP4)."""
  bits = setting.bits_per_param
  return [
      util.data_parallel(bits),
      util.diloco(sync_every, bits),
      util.streaming(sync_every, bits_per_param=bits, name=TABLE4_COLUMNS[2]),
      util.streaming(sync_every, overlap_steps=1, bits_per_param=bits,
                     name=TABLE4_COLUMNS[3]),
      util.streaming(sync_every, overlap_steps=1, bits_per_param=4,
                     name=TABLE4_COLUMNS[4]),
  ]


def reproduce_table4(setting: PaperSetting = STREAMING_DILOCO_SETTING,
                     targets=TABLE_CU, sync_every: int = 100, rows=None,
                     workloads: "dict[str, util.Workload] | None" = None
                     ) -> dict[tuple[str, str], list[float]]:
  """Gbit/s (unsnapped) per ``(model, column)`` and CU target.

  Args:
    setting: M, latency, bits and link order.
    targets: the CU targets.
    sync_every: H.
    rows: ``(model, column)`` keys to compute; every row by default.
    workloads: the models; ``PAPER_WORKLOADS`` by default.
  """
  workloads = PAPER_WORKLOADS if workloads is None else workloads
  methods = {m.name: m for m in table4_methods(sync_every, setting)}
  rows = [(w, c) for w in workloads for c in TABLE4_COLUMNS] if rows is None else rows
  return {(model, column): [setting.required_gbit(methods[column], workloads[model], c)
                            for c in targets]
          for model, column in rows}


# Table 6's models and step times (MFU 60%). Layers: 48 for the 10B (the
# scaling-law paper's Table 3), 126 for Llama 3 405B and 61 for DeepSeek-V3
# (their published shapes); N is the parameters exchanged (all 671B of
# DeepSeek-V3's experts).
TABLE6_WORKLOADS = {
    "10B": util.Workload(util.ModelShape(48, 10e9), 0.8),
    "Llama3-405B": util.Workload(util.ModelShape(126, 405e9), 26.0),
    "DeepSeek-V3-671B": util.Workload(util.ModelShape(61, 671e9), 20.0),
}

# Table 6 of arXiv 2503.09799: Gbit/s for 50/80/90/95/99% CU, keyed by
# (model, H); H = 1 is data-parallel (the paper's "DiLoCo, H = 1" rows repeat
# it). math.inf is the paper's "1000+".
PAPER_TABLE6 = {
    ("10B", 1): (104.8, 184.2, 222.3, 222.3, 390.7),
    ("10B", 10): (16.0, 49.4, 86.8, 152.6, 222.3),
    ("10B", 50): (3.0, 11.0, 23.3, 41.0, 126.5),
    ("10B", 100): (1.4, 6.2, 13.3, 23.3, 86.8),
    ("10B", 300): (0.5, 2.0, 4.3, 9.1, 41.0),
    ("Llama3-405B", 1): (126.5, 222.3, 268.3, 323.8, 323.8),
    ("Llama3-405B", 10): (19.3, 72.0, 126.5, 184.2, 268.3),
    ("Llama3-405B", 50): (3.6, 13.3, 28.1, 59.6, 184.2),
    ("Llama3-405B", 100): (2.0, 7.5, 16.0, 33.9, 126.5),
    ("Llama3-405B", 300): (0.7, 3.0, 6.2, 13.3, 59.6),
    ("DeepSeek-V3-671B", 1): (323.8, 569.0, 686.6, 686.6, math.inf),
    ("DeepSeek-V3-671B", 10): (49.4, 152.6, 268.3, 390.7, 686.6),
    ("DeepSeek-V3-671B", 50): (7.5, 33.9, 72.0, 126.5, 390.7),
    ("DeepSeek-V3-671B", 100): (4.3, 16.0, 41.0, 72.0, 268.3),
    ("DeepSeek-V3-671B", 300): (1.7, 6.2, 13.3, 28.1, 126.5),
}


def table6_method(sync_every: int, setting: PaperSetting = SCALING_LAWS_SETTING
                  ) -> util.Method:
  """Data-parallel for H = 1, blocking DiLoCo otherwise."""
  if sync_every == 1:
    return util.data_parallel(setting.bits_per_param)
  return util.diloco(sync_every, setting.bits_per_param)


def reproduce_table6(setting: PaperSetting = SCALING_LAWS_SETTING,
                     rows=None, targets=TABLE_CU
                     ) -> dict[tuple[str, int], list[float]]:
  """Gbit/s (unsnapped) per Table 6 row ``(model, H)`` and CU target.

  Args:
    setting: M, latency, bits and link order.
    rows: ``(model, H)`` keys of ``PAPER_TABLE6``; all by default.
    targets: the CU targets.
  """
  rows = list(PAPER_TABLE6) if rows is None else rows
  return {(model, h): [setting.required_gbit(table6_method(h, setting),
                                             TABLE6_WORKLOADS[model], c)
                       for c in targets]
          for model, h in rows}


class Cell(NamedTuple):
  """One cell of a paper's table beside ours.

  Attributes:
    row: the row's label, e.g. ``"10B DiLoCo"`` or ``"10B H=100"``.
    target_cu: the CU the cell is for.
    ours: our bandwidth, Gbit/s, unsnapped.
    ours_on_grid: ``snap_to_grid(ours)`` (``math.inf`` above 1000).
    paper: the printed value (``math.inf`` for "1000+").
    grid_error: ``grid_error(ours, paper)``: 0 on the same grid point.
    error: ``ours / paper − 1`` unsnapped (against 1000 for "1000+", and 0
      when ours is above it too).
  """

  row: str
  target_cu: float
  ours: float
  ours_on_grid: float
  paper: float
  grid_error: float
  error: float


def _cells(label: str, ours_row, paper_row, targets) -> list[Cell]:
  cells = []
  for c, ours, paper in zip(targets, ours_row, paper_row):
    if math.isinf(paper):
      error = 0.0 if ours >= PAPER_GRID_GBIT[-1] else ours / PAPER_GRID_GBIT[-1] - 1
    else:
      error = ours / paper - 1
    cells.append(Cell(label, c, ours, snap_to_grid(ours), paper,
                      grid_error(ours, paper), error))
  return cells


def compare_table4(ours: dict, targets=TABLE_CU) -> list[Cell]:
  """Cells of ``reproduce_table4``'s result against ``PAPER_TABLE4``."""
  index = [TABLE_CU.index(c) for c in targets]
  return [cell for (model, column), row in ours.items()
          for cell in _cells(f"{model} {column}", row,
                             [PAPER_TABLE4[(model, column)][i] for i in index], targets)]


def compare_table6(ours: dict, targets=TABLE_CU) -> list[Cell]:
  """Cells of ``reproduce_table6``'s result against ``PAPER_TABLE6``."""
  index = [TABLE_CU.index(c) for c in targets]
  return [cell for (model, h), row in ours.items()
          for cell in _cells(f"{model} " + ("DP" if h == 1 else f"H={h}"), row,
                             [PAPER_TABLE6[(model, h)][i] for i in index], targets)]


def count_within(cells: list[Cell], tolerance: float = 0.15,
                 snapped: bool = True) -> int:
  """Cells whose (grid or unsnapped) error is at most ``tolerance``."""
  return sum(abs(c.grid_error if snapped else c.error) <= tolerance for c in cells)


def appendix_a_bandwidth(workload: util.Workload, sync_every: int,
                         target_cu: float, bits_per_param: float = 16.0) -> float:
  """Gbit/s for ``target_cu`` under the scaling-law paper's Appendix A model.

  Appendix A.2 bounds an all-reduce of N parameters over R chips by
  2N/W·(1 − 1/R) + ε and A.3 adds it to the compute time, so with many chips
  and no latency a round of H steps takes ``H·t + 2·bits·N / W`` and CU =
  H·t / (H·t + 2·bits·N / W). That is the idealized wall-clock model of the
  paper's Figures 6 and 12; kept here to show it is not Table 6's.
  """
  compute = sync_every * workload.step_seconds
  traffic_bits = 2 * bits_per_param * workload.model.num_params
  return traffic_bits / (compute * (1 / target_cu - 1)) / 1e9
