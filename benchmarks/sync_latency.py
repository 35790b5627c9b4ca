"""NoLoCo's pairwise sync against ring and tree all-reduce, from N = 8 to 4096.

  python benchmarks/sync_latency.py
  python benchmarks/sync_latency.py --bytes_per_param=2 --latency_ms=30

Prints, for the NoLoCo paper's 125M, 1.3B and 6.8B models at 100 Mbit/s and
1 Gbit/s, the seconds of one outer synchronization under NoLoCo's pairwise
exchange (2 tensors to one peer), a ring all-reduce and a tree all-reduce of
the outer gradient, and the speed-up of the pairwise exchange over each. The
paper's claim: about log2 N over the tree, so about 10x at 1024 workers.
This is a closed-form model (lowcomm_jax/sim/latency.py), not a measurement;
it writes benchmarks/results/sync_latency.json.
"""

import json
import os

from absl import app, flags

_BYTES = flags.DEFINE_float("bytes_per_param", 4.0, "4 for fp32 tensors, 2 for bf16.")
_LATENCY_MS = flags.DEFINE_float("latency_ms", 50.0, "One-way link latency (internet preset: 50).")
_OUT = flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results",
                                               "sync_latency.json"), "JSON output path.")


def main(argv):
  del argv
  from lowcomm_jax.sim import latency

  specs = [f"100Mbit,{_LATENCY_MS.value}ms", f"1Gbit,{_LATENCY_MS.value}ms"]
  rows = latency.latency_table(networks=specs, bytes_per_param=_BYTES.value)
  print(f"one outer sync, {_BYTES.value:g} bytes/param, latency {_LATENCY_MS.value:g} ms; "
        "seconds (speed-up of pairwise over ring / tree)")
  for name, params in latency.NOLOCO_MODELS.items():
    for spec in specs:
      bandwidth = spec.split(",")[0]
      print(f"\n{name} ({params / 1e9:.2f}B params) at {bandwidth}/s")
      print(f"{'N':>6} {'pairwise':>10} {'ring':>10} {'tree':>11} {'vs ring':>8} "
            f"{'vs tree':>8} {'log2 N':>7}")
      for row in rows:
        if row["model"] != name or row["bandwidth_bits_per_s"] != (
            1e8 if bandwidth == "100Mbit" else 1e9):
          continue
        print(f"{row['workers']:>6} {row['pairwise_s']:>10.1f} {row['ring_s']:>10.1f} "
              f"{row['tree_s']:>11.1f} {row['speedup_vs_ring']:>7.2f}x "
              f"{row['speedup_vs_tree']:>7.2f}x {row['log2_workers']:>7.0f}")
  headline = [r for r in rows if r["workers"] == 1024]
  low = min(r["speedup_vs_tree"] for r in headline)
  high = max(r["speedup_vs_tree"] for r in headline)
  print(f"\nspeed-up over tree all-reduce at N=1024: {low:.2f}x to {high:.2f}x "
        "(paper: ~10x, log2 1024 = 10)")
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(dict(bytes_per_param=_BYTES.value, latency_s=_LATENCY_MS.value / 1e3,
                   models=latency.NOLOCO_MODELS, rows=rows,
                   speedup_vs_tree_at_1024=[low, high]), f, indent=1)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
