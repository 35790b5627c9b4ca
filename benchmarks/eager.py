"""Eager outer updates against the other ways to overlap DiLoCo's outer all-reduce, as the eager
paper's Table 2 compares them (arXiv 2502.12996), priced on slow links.

  python benchmarks/eager.py                       # tiny, 600 steps, H = 30, M = 2 and 4, 2 seeds
  python benchmarks/eager.py --model=small --steps=3000 --seeds=2

Rows (each through the Trainer, M replicas on this process, every row the same tokens per step):

  no overlap            DiLoCo: the all-reduce blocks the next step
  1-inner-step overlap  Streaming DiLoCo with one fragment, τ = 1 (α = 0)
  naive delay           outer.naive_delay: τ = H, the previous outer step's mean applied as it is
  eager                 outer.eager: τ = H, each worker's own fresh Δ in place of its stale share
  eager 2-outer-steps   outer.eager with τ = 2H: each mean lands two outer steps late

With --lower_outer_lr=η, the naive delay and eager again at that outer learning rate (the paper's
"naive + lower outer LR" row; the others keep 0.7); --outer_momentum sets every row's outer
momentum (0.9 by default, the paper's); --rows picks rows by name, --replicas the values
of M and --seeds the seeds. A run directory already finished in --workdir is read back, not trained
again; with --records, each finished run's row (a small JSON file per run) is kept in that folder
and read back instead of training, so that a long table is assembled over several invocations and
the files can be kept beside the results.

Per row: the final eval loss (mean over seeds, each seed listed), bytes sent per worker, and on each
link the simulated wall time of the whole run and its compute utilization: the run's ledger on the
virtual clock (`sim.clock.simulate_run`) with the compute time of the Streaming DiLoCo paper's 1B
model (0.1 s a step, `sim.paper_tables.PAPER_WORKLOADS`) and its bytes scaled to the `sdl_1b`
preset's parameter count, so that the figures say what these schedules cost at that size whatever
model trained here. A plot: eval loss against simulated wall time, a panel per link.

Writes benchmarks/results/eager.json and eager.png.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import statistics
import sys
import tempfile

from absl import app, flags, logging

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

_MODEL = flags.DEFINE_string("model", "tiny", "Model preset that trains.")
_STEPS = flags.DEFINE_integer("steps", 600, "Steps of every run.")
_SYNC_EVERY = flags.DEFINE_integer("sync_every", 30, "H.")
_REPLICAS = flags.DEFINE_list("replicas", ["2", "4"], "Values of M.")
_SEEDS = flags.DEFINE_integer("seeds", 2, "Seeds per row.")
_BATCH = flags.DEFINE_integer("batch", 16, "Sequences per step over all replicas.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 60, "Evaluation period in steps.")
_LOWER_LR = flags.DEFINE_float("lower_outer_lr", 0.0, "If > 0: the naive delay and eager rows "
                               "again at this outer learning rate (the others use 0.7).")
_MOMENTUM = flags.DEFINE_float("outer_momentum", 0.9, "Outer Nesterov momentum of every row.")
_ROWS = flags.DEFINE_list("rows", [], "Only these rows (default: every row).")
_WORKDIR = flags.DEFINE_string("workdir", "", "Folder of the runs (default: a temporary one).")
_RECORDS = flags.DEFINE_string("records", "", "Folder of one JSON record per finished run, read "
                               "back instead of training ('' for none).")
_OUT = flags.DEFINE_string("out", str(RESULTS / "eager.json"), "JSON output path.")
_PLOT = flags.DEFINE_string("plot", str(RESULTS / "eager.png"), "Plot path ('' for none).")

LINKS = {"100 Mbit/s": "100Mbit,0s", "1 Gbit/s": "1Gbit,0s", "10 Gbit/s": "10Gbit,0s"}
PRICED_AS = "sdl_1b"


def rows(sync_every: int, lower_lr: float = 0.0, momentum: float = 0.9) -> dict[str, dict]:
  """Each row's config changes (besides M); with `lower_lr`, the naive delay and eager again at
  that outer learning rate (the paper's "naive + lower outer LR"); `momentum`: every row's."""
  h = {"outer.sync_every": sync_every, "outer_optimizer.momentum": momentum}
  late = {**h, "algorithm": "diloco", "outer.overlap_steps": sync_every}
  out = {"no overlap": {**h, "algorithm": "diloco"},
         "1-inner-step overlap": {**h, "algorithm": "streaming_diloco", "outer.num_fragments": 1,
                                  "outer.overlap_steps": 1},
         "naive delay": {**late, "outer.naive_delay": True},
         "eager": {**late, "outer.eager": True},
         "eager 2-outer-steps": {**h, "algorithm": "diloco", "outer.overlap_steps": 2 * sync_every,
                                 "outer.eager": True}}
  if lower_lr:
    lower = {"outer_optimizer.learning_rate": lower_lr}
    out[f"naive delay (η {lower_lr})"] = {**out["naive delay"], **lower}
    out[f"eager (η {lower_lr})"] = {**out["eager"], **lower}
  return out


def _task():
  import bench  # pylint: disable=g-import-not-at-top (benchmarks/, beside this file)
  return bench.Task(model=_MODEL.value, corpus="stdlib", seq_len=_SEQ_LEN.value,
                    batch=_BATCH.value, steps=_STEPS.value, target_loss=0.0,
                    sync_every=_SYNC_EVERY.value, eval_every=_EVAL_EVERY.value, eval_batches=4,
                    seeds=_SEEDS.value, accelerator="", peak_flops=1.0, mfu=1.0,
                    warmup_steps=_SYNC_EVERY.value)


def priced_on_links(events, num_params: int, steps: int) -> dict:
  """Per link: the clock's wall time of `steps` steps and its compute utilization, with the paper
  1B model's step time and the events' bytes scaled to `PRICED_AS`'s parameter count."""
  from lowcomm_jax import models  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.sim import clock, paper_tables  # pylint: disable=g-import-not-at-top
  scale = models.param_count(models.get_model_config(PRICED_AS)) / num_params
  scaled = [e._replace(payload_bytes=round(e.payload_bytes * scale)) for e in events]
  step_seconds = paper_tables.PAPER_WORKLOADS["1B"].step_seconds
  out = {}
  for link, spec in LINKS.items():
    timeline = clock.simulate_run(step_seconds, scaled, spec, num_steps=steps)
    out[link] = {"seconds": timeline.wall_seconds, "utilization": timeline.compute_utilization}
  return out


def train(task, name: str, changes: dict, m: int, seed: int, work: pathlib.Path) -> dict:
  import bench  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import Trainer, hooks  # pylint: disable=g-import-not-at-top
  config = bench.make_config(task, {**changes, "num_replicas": m}, seed, 1)
  trainer = Trainer(config, work)
  final = hooks.FinalState()
  summary = trainer.run(hooks=[final])
  # a finished run directory is read back: its ledger traced from the abstract state
  state = trainer.abstract_state() if summary.get("complete_before_start") else final.state
  metrics = [json.loads(l) for l in (work / "metrics.jsonl").read_text().splitlines()]
  curve = [(r["step"], r["eval_loss"]) for r in metrics if "eval_loss" in r]
  if not curve or curve[-1][0] != task.steps:
    curve.append((task.steps, summary["final_eval_loss"]))
  events_of = lambda step: trainer.comm_events(step, state)
  return {"row": name, "replicas": m, "seed": seed, "final_eval_loss": summary["final_eval_loss"],
          "bytes_per_worker": summary["bytes_sent_per_worker"]["total"], "curve": curve,
          "links": priced_on_links(events_of(task.steps), trainer.num_params, task.steps),
          "curve_links": [priced_on_links(events_of(step), trainer.num_params, step)
                          for step, _ in curve]}


def summarize(runs: list[dict]) -> list[dict]:
  """One line per (row, M): the seeds' mean loss, each seed's, bytes, and per link the mean wall
  time and utilization; loss relative to the no-overlap row of the same M."""
  lines = []
  for (name, m) in dict.fromkeys((r["row"], r["replicas"]) for r in runs):
    rs = [r for r in runs if r["row"] == name and r["replicas"] == m]
    lines.append({
        "row": name, "replicas": m, "eval_loss": statistics.mean(r["final_eval_loss"] for r in rs),
        "eval_loss_per_seed": [r["final_eval_loss"] for r in rs],
        "bytes_per_worker": rs[0]["bytes_per_worker"],
        "links": {link: {k: statistics.mean(r["links"][link][k] for r in rs)
                         for k in ("seconds", "utilization")} for link in LINKS}})
  for line in lines:
    base = [x for x in lines if x["row"] == "no overlap" and x["replicas"] == line["replicas"]]
    line["vs_no_overlap"] = line["eval_loss"] / base[0]["eval_loss"] - 1 if base else None
  return lines


def plot(path: str, runs: list[dict]) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(LINKS), figsize=(5 * len(LINKS), 4), sharey=True)
  names = list(dict.fromkeys(r["row"] for r in runs))
  colors = {name: f"C{i}" for i, name in enumerate(names)}
  for ax, link in zip(axes, LINKS):
    for r in runs:
      if r["seed"]:
        continue
      xs = [c[link]["seconds"] / 3600 for c in r["curve_links"]]
      ax.plot(xs, [loss for _, loss in r["curve"]], color=colors[r["row"]],
              linestyle="-" if r["replicas"] == min(x["replicas"] for x in runs) else "--",
              label=f"{r['row']}, M = {r['replicas']}")
    ax.set_title(link)
    ax.set_xlabel(f"simulated hours ({PRICED_AS}, 0.1 s a step)")
  axes[0].set_ylabel("eval loss")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  task = _task()
  base = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="eager-bench-"))
  runs = []
  for m in (int(x) for x in _REPLICAS.value):
    for name, changes in rows(task.sync_every, _LOWER_LR.value, _MOMENTUM.value).items():
      if _ROWS.value and name not in _ROWS.value:
        continue
      for seed in range(_SEEDS.value):
        run_name = f"{name.replace(' ', '_')}_seed{seed}" + (
            f"_momentum{_MOMENTUM.value}" if _MOMENTUM.value != 0.9 else "")
        record = pathlib.Path(_RECORDS.value) / f"m{m}_{run_name}.json" if _RECORDS.value else None
        if record is not None and record.is_file():
          runs.append(json.loads(record.read_text()))
        else:
          runs.append(train(task, name, changes, m, seed, base / f"m{m}" / run_name))
          if record is not None:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(runs[-1]) + "\n")
        print(f"M = {m}, {name}, seed {seed}: eval loss {runs[-1]['final_eval_loss']:.4f}",
              flush=True)
  lines = summarize(runs)
  out = {"date": datetime.date.today().isoformat(), "model": _MODEL.value, "steps": _STEPS.value,
         "sync_every": _SYNC_EVERY.value, "batch": _BATCH.value, "seq_len": _SEQ_LEN.value,
         "outer_momentum": _MOMENTUM.value,
         "priced_as": f"{PRICED_AS} parameters, 0.1 s a step", "links": LINKS,
         "command": " ".join(["python", *sys.argv]), "rows": lines, "runs": runs}
  pathlib.Path(_OUT.value).write_text(json.dumps(out, indent=1) + "\n")
  if _PLOT.value:
    plot(_PLOT.value, runs)
  print(f"{'row':22s} {'M':>2s} {'loss':>7s} {'vs none':>8s} " +
        " ".join(f"{link + ' h / CU':>20s}" for link in LINKS))
  for x in lines:
    cells = " ".join(f"{x['links'][l]['seconds'] / 3600:9.2f} / {x['links'][l]['utilization']:6.3f}"
                     for l in LINKS)
    versus = "" if x["vs_no_overlap"] is None else f"{100 * x['vs_no_overlap']:+7.2f}%"
    print(f"{x['row']:22s} {x['replicas']:2d} {x['eval_loss']:7.4f} {versus:>8s} {cells}")


if __name__ == "__main__":
  app.run(main)
