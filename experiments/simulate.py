"""Reproduces Streaming DiLoCo's Table 4 and draws compute-utilization curves.

  python experiments/simulate.py
  python experiments/simulate.py --target_cu=0.9 --sync_every=30 --out_dir=runs/sim_h30

Prints, per model (1B, 10B, 100B) and method (data-parallel, DiLoCo,
Streaming DiLoCo, + overlap τ=1, + overlap + FP4), the WAN bandwidth in
Gbit/s that reaches the target compute utilization, next to the paper's value
and the relative error, and writes OUT_DIR/cu_vs_bandwidth.png and
OUT_DIR/table4.json. The model behind the numbers is documented in
lowcomm_jax/sim/utilization.py. Pure Python, a few seconds on one CPU core.
"""

import json
import os

from absl import flags

from lowcomm_jax import cli

_OUT_DIR = flags.DEFINE_string("out_dir", "runs/simulate", "Where to write the plot and JSON.")
_TARGET_CU = flags.DEFINE_float("target_cu", 0.95, "Compute utilization to reach, in (0, 1).")
_SYNC_EVERY = flags.DEFINE_integer("sync_every", 100, "H, inner steps per outer round.")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 2, "M, workers (datacenters).")
_LATENCY = flags.DEFINE_float("latency_s", 0.0, "Link latency in seconds (paper: none).")


def main(argv):
  del argv
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  from lowcomm_jax.sim import utilization

  methods = utilization.table4_methods(_SYNC_EVERY.value)
  table = utilization.reproduce_table4(_TARGET_CU.value, _SYNC_EVERY.value,
                                       _NUM_WORKERS.value, _LATENCY.value)
  compare = (_TARGET_CU.value == 0.95 and _SYNC_EVERY.value == 100
             and _NUM_WORKERS.value == 2 and _LATENCY.value == 0.0)
  print(f"Gbit/s for {_TARGET_CU.value:.0%} compute utilization, "
        f"M={_NUM_WORKERS.value}, H={_SYNC_EVERY.value}, "
        f"latency {_LATENCY.value * 1e3:g} ms"
        + ("  (ours / paper, relative error)" if compare else ""))
  width = 22
  print(f"{'model':<6}" + "".join(f"{m.name:>{width}}" for m in methods))
  worst = 0.0
  for name, row in table.items():
    cells = []
    for col, ours in enumerate(row):
      if compare:
        paper = utilization.PAPER_TABLE4[name][col]
        err = ours / paper - 1
        worst = max(worst, abs(err))
        cells.append(f"{ours:7.1f} / {paper:5.1f} {err:+6.1%}")
      else:
        cells.append(f"{ours:7.2f}")
    print(f"{name:<6}" + "".join(f"{c:>{width}}" for c in cells))
  if compare:
    print(f"largest relative error: {worst:.1%}")

  os.makedirs(_OUT_DIR.value, exist_ok=True)
  bandwidths = np.logspace(8, 12.5, 46)  # 0.1 Gbit/s to ~3 Tbit/s
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
  for ax, (name, workload) in zip(axes, utilization.PAPER_WORKLOADS.items()):
    for method in methods:
      cu = utilization.utilization_curve(method, workload, _NUM_WORKERS.value,
                                         bandwidths, _LATENCY.value)
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
  with open(os.path.join(_OUT_DIR.value, "table4.json"), "w") as f:
    json.dump(dict(target_cu=_TARGET_CU.value, sync_every=_SYNC_EVERY.value,
                   num_workers=_NUM_WORKERS.value, latency_s=_LATENCY.value,
                   methods=[m.name for m in methods], gbit_per_s=table,
                   paper=utilization.PAPER_TABLE4 if compare else None),
              f, indent=1)
  print(f"wrote {png}")


if __name__ == "__main__":
  cli.run(main)
