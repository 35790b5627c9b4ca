"""Convergence at equal tokens: data-parallel against the DiLoCo family on the real corpus.

  python benchmarks/convergence.py [--steps=400 --only=diloco --workdir=runs/convergence]

Every run trains the `small` model on the Python standard library's source for the same number of
steps with the same tokens per step: M replicas × 8 sequences × 128 bytes (DiLoCo: each replica its
own shard; data-parallel: one batch of M × 8 split over M devices). The table gives the final eval
loss (global parameters for DiLoCo), its ratio to data-parallel at the same M, the bytes each worker
sent, and the ratio of those bits to data-parallel's. Finished runs are reused (the Trainer
resumes), so the benchmark can be extended and rerun. Writes benchmarks/results/convergence.json and
benchmarks/results/convergence.png.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app, flags

from lowcomm_jax import config as config_lib
from lowcomm_jax.train import Trainer

_STEPS = flags.DEFINE_integer("steps", 400, "Steps per run.")
_ONLY = flags.DEFINE_string("only", "", "Run only the runs whose name contains this.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/convergence", "Where the runs live.")
_RESULTS = pathlib.Path(__file__).parent / "results"


def runs() -> dict[str, dict]:
  """name -> config changes. Data-parallel at M sets the baseline of every run with M replicas."""
  table = {}
  for m in (2, 4, 8):
    table[f"dp M={m}"] = {"algorithm": "dp", "mesh.data": m, "data.batch_size": 8 * m, "_m": m}
    for h in (10, 50, 100) if m < 8 else (100,):
      table[f"diloco M={m} H={h}"] = {"algorithm": "diloco", "num_replicas": m,
                                      "outer.sync_every": h,
                                      "mesh.data": 1, "_m": m}
  # NoLoCo in pairs at H = 50 against DiLoCo at H = 100, the paper's settings (docs/algorithms.md
  # §2.5).
  for m in (4, 8):
    table[f"noloco M={m} H=50"] = {"algorithm": "noloco", "num_replicas": m,
                                   "noloco.sync_every": 50,
                                   "mesh.data": 1, "_m": m}
  table["noloco M=4 H=50 e3m0"] = {"algorithm": "noloco", "num_replicas": 4,
                                   "noloco.sync_every": 50,
                                  "noloco.codec": "e3m0", "mesh.data": 1, "_m": 4}
  # Streaming DiLoCo at M = 2, H = 60 (divisible by P + 1 rows: the `small` model has 6 layers, so
  # P ∈ {2, 3} block fragments plus the non-block fragment), against DiLoCo at the same H.
  table["diloco M=2 H=60"] = {"algorithm": "diloco", "num_replicas": 2, "outer.sync_every": 60,
                              "mesh.data": 1, "_m": 2}
  for p, tau, alpha, codec in ((2, 0, 0.0, "none"), (2, 1, 0.5, "none"), (3, 0, 0.0, "none"),
                               (3, 1, 0.5, "none"), (3, 2, 0.5, "none"), (3, 1, 0.0, "none"),
                               (3, 1, 0.5, "e3m0")):
    name = f"streaming M=2 H=60 P={p} τ={tau} α={alpha}" + (f" {codec}" if codec != "none" else "")
    table[name] = {"algorithm": "streaming_diloco", "num_replicas": 2, "outer.sync_every": 60,
                   "outer.num_fragments": p, "outer.overlap_steps": tau,
                   "outer.merge_alpha": alpha,
                   "outer.codec": codec, "mesh.data": 1, "_m": 2}
  return table


def make_config(changes: dict, steps: int | None = None, eval_every: int = 100,
                checkpoint_every: int = 100):
  """The `small` model at 8 × 128 bytes per replica per step, with `changes` (keys "_*" skipped)."""
  c = config_lib.default_config()
  c.model.size = "small"
  c.num_steps = steps or _STEPS.value
  c.data.seq_len, c.data.batch_size = 128, 8
  c.eval.every, c.eval.num_batches, c.eval.batch_size = eval_every, 16, 16
  c.checkpoint.every = checkpoint_every
  c.log_every = 20
  c.progress_bar = False
  return config_lib.override(c, {k: v for k, v in changes.items() if not k.startswith("_")})


def result_row(name: str, changes: dict, summary: dict, workdir: pathlib.Path) -> dict:
  """What the tables keep of a finished run: final eval loss, bytes, the eval curve."""
  curve = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  row = {"name": name, "replicas": changes["_m"], "algorithm": changes["algorithm"],
         "final_eval_loss": summary["final_eval_loss"], "tokens": summary["tokens"],
         "bytes_per_worker": summary["bytes_sent_per_worker"]["total"],
         "peak_bytes_per_sync": summary["bytes_sent_per_worker"]["peak_per_sync"],
         "wall_time_s": summary["wall_time_s"],
         "bits_per_param_per_step": summary["bytes_sent_per_worker"]["bits_per_param_per_step"],
         "eval_curve": [(r["step"], r["eval_loss"]) for r in curve if "eval_loss" in r]}
  if changes["algorithm"] == "noloco":  # no global model: the replicas' losses and their spread
    row["final_eval_loss_replicas"] = summary["final_eval_loss_replicas"]
    row["weight_spread_curve"] = [
      (r["step"], r["weight_spread"]) for r in curve if "weight_spread" in r
    ]
  return row


def main(argv):
  del argv
  results = {}
  out = _RESULTS / "convergence.json"
  if out.exists():
    results = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
  for name, changes in runs().items():
    if _ONLY.value and _ONLY.value not in name:
      continue
    workdir = pathlib.Path(_WORKDIR.value) / (name.replace(" ", "_").replace("=", "")
                                               .replace("τ", "tau").replace("α", "alpha"))
    if name in results and (workdir / "summary.json").exists():
      continue  # finished: a resumed Trainer would take no step and evaluate nothing
    print(f"== {name}", flush=True)
    summary = Trainer(make_config(changes), workdir).run()
    results[name] = result_row(name, changes, summary, workdir)
  for r in results.values():
    base = results.get(f"dp M={r['replicas']}")
    if base:
      r["loss_ratio_to_dp"] = r["final_eval_loss"] / base["final_eval_loss"]
      r["bits_ratio_to_dp"] = r["bytes_per_worker"] / base["bytes_per_worker"]
      r["peak_ratio_to_dp"] = r["peak_bytes_per_sync"] / base["peak_bytes_per_sync"]
  rows = sorted(results.values(), key=lambda r: (r["replicas"], r["algorithm"] != "dp", r["name"]))
  print(f"\n{'run':<44}{'tokens':>10}{'eval loss':>11}{'vs dp':>8}{'MB/worker':>11}"
        f"{'bits vs dp':>12}{'peak MB':>9}")
  for r in rows:
    print(f"{r['name']:<44}{r['tokens']:>10}{r['final_eval_loss']:>11.4f}"
          f"{r.get('loss_ratio_to_dp', 0):>8.3f}{r['bytes_per_worker'] / 1e6:>11.2f}"
          f"{r.get('bits_ratio_to_dp', 0):>12.4f}{r['peak_bytes_per_sync'] / 1e6:>9.3f}")
  _RESULTS.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"steps": _STEPS.value, "runs": rows}, indent=1))
  fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
  for ax, m in zip(axes, (2, 4, 8)):
    for r in rows:
      if r["replicas"] == m and r["eval_curve"]:
        steps, losses = zip(*r["eval_curve"])
        ax.plot(steps, losses, "o-" if r["algorithm"] == "dp" else ".-", label=r["name"], lw=1)
    ax.set_title(f"M = {m}")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
  axes[0].set_ylabel("eval loss (nats/byte)")
  fig.tight_layout()
  fig.savefig(_RESULTS / "convergence.png", dpi=100)
  print(f"wrote {out} and {_RESULTS / 'convergence.png'}")


if __name__ == "__main__":
  app.run(main)
