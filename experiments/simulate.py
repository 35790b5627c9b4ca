"""Holds the compute-utilization simulator to Streaming DiLoCo's Table 4 and
the DiLoCo scaling-law paper's Table 6, and draws CU-vs-bandwidth curves.

  python experiments/simulate.py                    # both tables + plot
  python experiments/simulate.py --table=6 --out_dir=runs/sim_t6
  python experiments/simulate.py --table=4 --target_cu=0.9 --sync_every=30

Table 4 (arXiv 2501.18512): Gbit/s for 95% CU per model (1B, 10B, 100B) and
method (data-parallel, DiLoCo, Streaming DiLoCo, + overlap τ=1, + overlap +
FP4). Table 6 (arXiv 2503.09799): Gbit/s for 50/80/90/95/99% CU for
data-parallel and DiLoCo (H = 10..300) on a 10B model, Llama 3 405B and
DeepSeek-V3. Both papers report the smallest bandwidth of
numpy.logspace(-1, 3, 50) Gbit/s that reaches the target, so each cell prints
ours (exact), ours snapped to that grid, the paper's value and the error of
the snapped value; the worst cell closes each table. Writes
OUT_DIR/simulator_tables.json (and cu_vs_bandwidth.png for Table 4). The
model is documented in lowcomm_jax/sim/utilization.py. Pure Python, seconds.
"""

import json
import math
import os

from absl import flags

from lowcomm_jax import cli

_OUT_DIR = flags.DEFINE_string("out_dir", "runs/simulate", "Where to write the plot and JSON.")
_TABLE = flags.DEFINE_enum("table", "both", ["4", "6", "both"], "Which paper table to reproduce.")
_TARGET_CU = flags.DEFINE_float("target_cu", 0.95, "Table 4: CU to reach, in (0, 1).")
_SYNC_EVERY = flags.DEFINE_integer("sync_every", 100, "Table 4: H, inner steps per round.")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 2, "M, workers (datacenters).")
_LATENCY = flags.DEFINE_float("latency_s", 0.0, "Link latency in seconds (papers: none).")
_PLOT = flags.DEFINE_bool("plot", True, "Draw cu_vs_bandwidth.png (Table 4's models).")


def _cell(ours, paper, util):
  """Text and JSON record of one cell: ours, snapped, paper, error."""
  snapped = util.snap_to_grid(ours)
  rec = dict(ours=ours, ours_on_grid=snapped, paper=paper)
  if paper is None:
    return f"{ours:8.2f}", rec
  err = util.grid_error(ours, paper)
  rec["error"] = err
  paper_txt = "1000+" if math.isinf(paper) else f"{paper:.1f}"
  snap_txt = "1000+" if math.isinf(snapped) else f"{snapped:.1f}"
  return f"{ours:7.1f}>{snap_txt:>6}/{paper_txt:>6} {err:+6.1%}", rec


def _worst(records):
  worst = max(records, key=lambda r: abs(r[1]["error"]))
  return worst[0], worst[1]


def _table4(util, setting):
  methods = util.table4_methods(_SYNC_EVERY.value)
  table = util.reproduce_table4(_TARGET_CU.value, _SYNC_EVERY.value,
                                setting.num_workers, setting.latency_s)
  compare = (_TARGET_CU.value == 0.95 and _SYNC_EVERY.value == 100
             and setting.num_workers == 2 and setting.latency_s == 0.0)
  print(f"Table 4 ({setting.name}): Gbit/s for {_TARGET_CU.value:.0%} CU, "
        f"M={setting.num_workers}, H={_SYNC_EVERY.value}, latency "
        f"{setting.latency_s * 1e3:g} ms"
        + ("; cells: ours > ours on the grid / paper, error" if compare else ""))
  width = 30
  print(f"{'model':<6}" + "".join(f"{m.name:>{width}}" for m in methods))
  records, out = [], {}
  for name, row in table.items():
    texts = []
    for col, ours in enumerate(row):
      paper = util.PAPER_TABLE4[name][col] if compare else None
      text, rec = _cell(ours, paper, util)
      texts.append(text)
      out[f"{name} {methods[col].name}"] = rec
      if compare:
        records.append((f"{name} {methods[col].name}", rec))
    print(f"{name:<6}" + "".join(f"{c:>{width}}" for c in texts))
  result = dict(setting=setting.name, target_cu=_TARGET_CU.value,
                sync_every=_SYNC_EVERY.value, num_workers=setting.num_workers,
                latency_s=setting.latency_s, cells=out)
  if compare:
    label, rec = _worst(records)
    raw = max(records, key=lambda r: abs(r[1]["ours"] / r[1]["paper"] - 1))
    print(f"worst cell on the grid: {label} {rec['error']:+.1%}; worst unsnapped: "
          f"{raw[0]} {raw[1]['ours'] / raw[1]['paper'] - 1:+.1%}; cells on the "
          f"paper's grid point: {sum(r[1]['error'] == 0 for r in records)}/15")
    result.update(worst_cell=label, worst_error=rec["error"])
  return result


def _table6(util, setting):
  table = util.reproduce_table6(setting)
  print(f"\nTable 6 ({setting.name}): Gbit/s for "
        + "/".join(f"{c:.0%}" for c in util.TABLE6_CU)
        + f" CU, M={setting.num_workers}, {setting.bits_per_param:g} bits; cells: "
        "ours > ours on the grid / paper, error")
  width = 27
  print(f"{'row':<24}" + "".join(f"{c:>{width}.0%}" for c in util.TABLE6_CU))
  records, out = [], {}
  for (model, h), row in table.items():
    label = f"{model} " + ("DP" if h == 1 else f"H={h}")
    texts = []
    for c, ours, paper in zip(util.TABLE6_CU, row, util.PAPER_TABLE6[(model, h)]):
      text, rec = _cell(ours, paper, util)
      texts.append(text)
      out[f"{label} {c:.0%}"] = rec
      records.append((f"{label} {c:.0%}", rec))
    print(f"{label:<24}" + "".join(f"{t:>{width}}" for t in texts))
  label, rec = _worst(records)
  within = sum(abs(r[1]["error"]) <= 0.15 for r in records)
  print(f"worst cell on the grid: {label} {rec['error']:+.1%}; cells within 15%: "
        f"{within}/{len(records)}")
  for r in out.values():  # JSON has no inf
    for k in ("paper", "ours_on_grid"):
      if r[k] is not None and math.isinf(r[k]):
        r[k] = "1000+"
  return dict(setting=setting.name, num_workers=setting.num_workers,
              bits_per_param=setting.bits_per_param, cells=out,
              worst_cell=label, worst_error=rec["error"])


def _plot(util, setting, methods):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  bandwidths = np.logspace(8, 12.5, 46)  # 0.1 Gbit/s to ~3 Tbit/s
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
  for ax, (name, workload) in zip(axes, util.PAPER_WORKLOADS.items()):
    for method in methods:
      cu = util.utilization_curve(method, workload, setting.num_workers,
                                  bandwidths, setting.latency_s)
      ax.plot(bandwidths / 1e9, np.array(cu) * 100, label=method.name)
    ax.axhline(_TARGET_CU.value * 100, color="grey", lw=0.8, ls=":")
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
  import dataclasses

  from lowcomm_jax.sim import utilization as util

  os.makedirs(_OUT_DIR.value, exist_ok=True)
  result = {}
  if _TABLE.value in ("4", "both"):
    setting = dataclasses.replace(util.STREAMING_DILOCO_SETTING,
                                  num_workers=_NUM_WORKERS.value,
                                  latency_s=_LATENCY.value)
    result["table4"] = _table4(util, setting)
    if _PLOT.value:
      print(f"wrote {_plot(util, setting, util.table4_methods(_SYNC_EVERY.value))}")
  if _TABLE.value in ("6", "both"):
    result["table6"] = _table6(util, util.SCALING_LAWS_SETTING)
  path = os.path.join(_OUT_DIR.value, "simulator_tables.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  cli.run(main)
