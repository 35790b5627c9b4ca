"""Holds the compute-utilization simulator to Streaming DiLoCo's Table 4 and
the DiLoCo scaling-law paper's Table 6, and draws CU-vs-bandwidth curves.

  python experiments/simulate.py                    # both tables + plot
  python experiments/simulate.py --table=6 --out_dir=runs/sim_t6
  python experiments/simulate.py --table=4 --link_order=fifo
  python experiments/simulate.py --table=4 --sync_every=30 --num_workers=4

Both tables give the Gbit/s needed for 50/80/90/95/99% compute utilization
(CU). Table 4 (arXiv 2501.18512): 1B, 10B and 100B models, columns
data-parallel, DiLoCo, Streaming DiLoCo, + overlap τ=1, + overlap + FP4, H =
100. Table 6 (arXiv 2503.09799): data-parallel and DiLoCo (H = 10..300) on a
10B model, Llama 3 405B and DeepSeek-V3. Both papers report the smallest
bandwidth of numpy.logspace(-1, 3, 50) Gbit/s that reaches the target, so
each cell prints ours (exact) > ours snapped to that grid / the paper's value
and the snapped error; each table closes with its count of cells within 15%
of the paper (on the grid, and unsnapped) and its worst cells. Settings that
differ from the paper's (H, M, latency) print ours alone. Writes
OUT_DIR/simulator_tables.json (and cu_vs_bandwidth.png for Table 4's
models). The model is documented in lowcomm_jax/sim/utilization.py, the
papers' settings in lowcomm_jax/sim/paper_tables.py. Pure Python, about 10 s
of CPU.
"""

import dataclasses
import json
import math
import os

from absl import flags

from lowcomm_jax import cli

_OUT_DIR = flags.DEFINE_string("out_dir", "runs/simulate", "Where to write the plot and JSON.")
_TABLE = flags.DEFINE_enum("table", "both", ["4", "6", "both"], "Which paper table to reproduce.")
_SYNC_EVERY = flags.DEFINE_integer("sync_every", 100, "Table 4: H, inner steps per round.")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 2, "M, workers (datacenters).")
_LATENCY = flags.DEFINE_float("latency_s", 0.0, "Link latency in seconds (papers: none).")
_LINK_ORDER = flags.DEFINE_enum("link_order", "deadline", ["deadline", "fifo"],
                                "Which waiting reduction the link serves first.")
_PLOT = flags.DEFINE_bool("plot", True, "Draw cu_vs_bandwidth.png (Table 4's models).")

_WIDTH = 26


def _fmt(gbit):
  """The paper's one decimal; two below 1 Gbit/s, where grid points are 0.07 apart."""
  if math.isinf(gbit):
    return "1000+"
  return f"{gbit:.2f}" if gbit < 1 else f"{gbit:.1f}"


def _print_rows(title, rows, cells, label_width):
  """One line per row: each CU's cell (ours > snapped / paper error)."""
  from lowcomm_jax.sim import paper_tables as pt
  print(title)
  print(f"{'row':<{label_width}}" + "".join(f"{c:>{_WIDTH}.0%}" for c in pt.TABLE_CU))
  by_row = {}
  for cell in cells or []:
    by_row.setdefault(cell.row, []).append(cell)
  for label, ours in rows:
    if label in by_row:
      texts = [f"{_fmt(c.ours):>6}>{_fmt(c.ours_on_grid):>6}/{_fmt(c.paper):>6} "
               f"{c.grid_error:+5.0%}" for c in by_row[label]]
    else:
      texts = [f"{o:7.2f}" for o in ours]
    print(f"{label:<{label_width}}" + "".join(f"{t:>{_WIDTH}}" for t in texts))


def _summary(name, cells):
  """Prints and returns the within-15% counts and worst cells."""
  from lowcomm_jax.sim import paper_tables as pt
  c95 = [c for c in cells if c.target_cu == 0.95]
  worst = max(cells, key=lambda c: abs(c.grid_error))
  raw = max(cells, key=lambda c: abs(c.error))
  summary = dict(
      cells=len(cells), within_15_on_grid=pt.count_within(cells),
      within_15_unsnapped=pt.count_within(cells, snapped=False),
      within_15_on_grid_95=pt.count_within(c95),
      within_15_unsnapped_95=pt.count_within(c95, snapped=False),
      worst_on_grid=f"{worst.row} {worst.target_cu:.0%}", worst_on_grid_error=worst.grid_error,
      worst_unsnapped=f"{raw.row} {raw.target_cu:.0%}", worst_unsnapped_error=raw.error)
  print(f"{name}: cells within 15% of the paper: {summary['within_15_on_grid']}/{len(cells)} "
        f"on the grid (95% CU: {summary['within_15_on_grid_95']}/{len(c95)}), "
        f"{summary['within_15_unsnapped']}/{len(cells)} unsnapped (95% CU: "
        f"{summary['within_15_unsnapped_95']}/{len(c95)}); worst on the grid: "
        f"{summary['worst_on_grid']} {worst.grid_error:+.1%} ({_fmt(worst.ours_on_grid)} vs "
        f"{_fmt(worst.paper)}); worst unsnapped: {summary['worst_unsnapped']} "
        f"{raw.error:+.1%} ({raw.ours:.2f} vs {_fmt(raw.paper)})")
  return summary


def _json_cells(cells):
  def num(x):  # JSON has no inf
    return "1000+" if math.isinf(x) else x
  return [dict(row=c.row, target_cu=c.target_cu, ours=c.ours, ours_on_grid=num(c.ours_on_grid),
               paper=num(c.paper), grid_error=c.grid_error, error=c.error) for c in cells]


def _table4(pt, setting):
  table = pt.reproduce_table4(setting, sync_every=_SYNC_EVERY.value)
  compare = (_SYNC_EVERY.value == 100 and setting.num_workers == 2
             and setting.latency_s == 0.0)
  cells = pt.compare_table4(table) if compare else None
  rows = [(f"{model} {column}", row) for (model, column), row in table.items()]
  _print_rows(f"Table 4 ({setting.name}): Gbit/s for each CU, M={setting.num_workers}, "
              f"H={_SYNC_EVERY.value}, latency {setting.latency_s * 1e3:g} ms, link order "
              f"{setting.link_order}" + ("; cells: ours > ours on the grid / paper, error"
                                         if compare else ""), rows, cells, 30)
  result = dict(setting=dataclasses.asdict(setting), sync_every=_SYNC_EVERY.value)
  if compare:
    result.update(summary=_summary("Table 4", cells), cells=_json_cells(cells))
  else:
    result["rows"] = {label: row for label, row in rows}
  return result


def _table6(pt, setting):
  table = pt.reproduce_table6(setting)
  compare = setting.num_workers == 2 and setting.latency_s == 0.0
  cells = pt.compare_table6(table) if compare else None
  rows = [(f"{model} " + ("DP" if h == 1 else f"H={h}"), row) for (model, h), row in table.items()]
  _print_rows(f"\nTable 6 ({setting.name}): Gbit/s for each CU, M={setting.num_workers}, "
              f"{setting.bits_per_param:g} bits, link order {setting.link_order}"
              + ("; cells: ours > ours on the grid / paper, error" if compare else ""),
              rows, cells, 24)
  result = dict(setting=dataclasses.asdict(setting))
  if compare:
    result.update(summary=_summary("Table 6", cells), cells=_json_cells(cells))
  else:
    result["rows"] = {label: row for label, row in rows}
  return result


def _plot(pt, util, setting):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  bandwidths = np.logspace(8, 12.5, 46)  # 0.1 Gbit/s to ~3 Tbit/s
  methods = pt.table4_methods(_SYNC_EVERY.value, setting)
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
  for ax, (name, workload) in zip(axes, pt.PAPER_WORKLOADS.items()):
    for method in methods:
      cu = util.utilization_curve(method, workload, setting.num_workers, bandwidths,
                                  setting.latency_s, link_order=setting.link_order)
      ax.plot(bandwidths / 1e9, np.array(cu) * 100, label=method.name)
    for target in pt.TABLE_CU:
      ax.axhline(target * 100, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_title(f"{name}, {workload.model.num_layers} layers, "
                 f"{workload.step_seconds:g} s/step")
    ax.set_xlabel("WAN bandwidth (Gbit/s)")
  axes[0].set_ylabel("compute utilization (%)")
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  png = os.path.join(_OUT_DIR.value, "cu_vs_bandwidth.png")
  fig.savefig(png, dpi=120)
  return png


def main(argv):
  del argv
  from lowcomm_jax.sim import paper_tables as pt, utilization as util

  os.makedirs(_OUT_DIR.value, exist_ok=True)
  result = {}
  overrides = dict(num_workers=_NUM_WORKERS.value, latency_s=_LATENCY.value,
                   link_order=_LINK_ORDER.value)
  if _TABLE.value in ("4", "both"):
    setting = dataclasses.replace(pt.STREAMING_DILOCO_SETTING, **overrides)
    result["table4"] = _table4(pt, setting)
    if _PLOT.value:
      print(f"wrote {_plot(pt, util, setting)}")
  if _TABLE.value in ("6", "both"):
    setting = dataclasses.replace(pt.SCALING_LAWS_SETTING, **overrides)
    result["table6"] = _table6(pt, setting)
  path = os.path.join(_OUT_DIR.value, "simulator_tables.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  cli.run(main)
