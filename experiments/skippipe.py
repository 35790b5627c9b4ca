"""SkipPipe training: skip-trained vs full-pipeline-trained models at equal steps
(docs/algorithms.md §3.4, §3.6).

  python experiments/skippipe.py --workdir=/tmp/skippipe            # ~10 min on 2 CPU cores
  python experiments/skippipe.py --workdir=/tmp/skippipe_quick --quick   # a smoke run

Each of the two trainings is a run of the one Trainer with `experiments/configs/skippipe.py`
(`:skip` and `:full`) in DIR/skippipe and DIR/full: checkpoints, resume and summary.json as any
run; rerunning the command resumes them. This script adds the comparison and the half-model test.

Plans the SkipPipe schedule on the 12-region preset (20 nodes, stages
[5,3,3,3,3,3], 4 of 6 stages per path = 33% skipped) and trains the `small`
model split into 6 stages along the schedule's per-micro-batch paths on the
stdlib corpus; a second model trains on the full pipeline (every micro-batch
through all 6 stages in order) with the same data, init and optimizer. Both are
evaluated with all layers in order and with stages removed (the paper's
half-model test: keep stage 0 and 2 of the other 5, every choice). Writes
metrics.json into the workdir and benchmarks/results/skippipe_training.{json,png}.
"""

import json
import pathlib
import time

from absl import flags

from lowcomm_jax import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for metrics.json.", required=True)
_STEPS = flags.DEFINE_integer("steps", 200, "Optimizer steps of each run.")
_QUICK = flags.DEFINE_bool("quick", False, "A few steps on fewer sequences: a smoke run.")
_MB_PER_NODE = flags.DEFINE_integer("microbatches_per_data_node", 2,
                                    "Micro-batches each of the 5 data nodes injects per step.")
_MB_SIZE = flags.DEFINE_integer("microbatch_size", 4, "Sequences per micro-batch.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Bytes per sequence.")
_LR = flags.DEFINE_float("learning_rate", 1e-3, "AdamW peak learning rate.")
_LAYERS_PER_STAGE = flags.DEFINE_integer("layers_per_stage", 1,
                                         "Layers per stage; the model has 6x this many.")
_SEED = flags.DEFINE_integer("seed", 0, "Init, data order and placement seed.")
_WRITE_RESULTS = flags.DEFINE_bool("write_results", True,
                                   "Also write benchmarks/results/skippipe_training.{json,png}.")

_RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _summary(losses: dict) -> dict:
  values = sorted(losses.values())
  return {"mean_loss": sum(values) / len(values), "min_loss": values[0], "max_loss": values[-1],
          "by_kept_stages": {"-".join(map(str, k)): v for k, v in losses.items()}}


def _config(variant: str):
  import importlib.util  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).resolve().parent / "configs" / "skippipe.py"
  spec = importlib.util.spec_from_file_location("skippipe_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant), module


def main(argv):
  del argv
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.skippipe import training  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import Trainer, hooks  # pylint: disable=g-import-not-at-top

  steps, mb_size, eval_n = _STEPS.value, _MB_SIZE.value, 8
  if _QUICK.value:
    steps, mb_size, eval_n = min(steps, 12), 2, 2
  lps = _LAYERS_PER_STAGE.value
  num_stages = 6
  workdir = pathlib.Path(_WORKDIR.value)

  trainers, schedule_s = {}, 0.0
  for name in ("skippipe", "full"):
    c, module = _config("skip" if name == "skippipe" else "full")
    num_mb = 5 * _MB_PER_NODE.value
    c.update_from_flattened_dict({
        "num_steps": steps, "seed": _SEED.value, "skippipe.placement_seed": _SEED.value,
        "skippipe.microbatches_per_data_node": _MB_PER_NODE.value, "pipeline.layers_per_stage": lps,
        "data.seq_len": _SEQ_LEN.value, "data.batch_size": num_mb * mb_size,
        "optimizer.learning_rate": _LR.value, "optimizer.warmup_steps": min(20, steps // 10),
        "eval.num_batches": eval_n, "eval.every": max(steps // 10, 1),
        "log_every": max(steps // 10, 1),
        "checkpoint.every": steps})
    if name == "full":
      c.skippipe.paths = module.full_paths(num_stages, num_mb)
    t0 = time.perf_counter()
    trainers[name] = Trainer(c, workdir / name)  # plans the SkipPipe schedule
    if name == "skippipe":
      schedule_s = time.perf_counter() - t0
  skip_paths = np.asarray(trainers["skippipe"].source.stage_paths)
  print(f"schedule ({schedule_s:.1f} s): {len(skip_paths)} micro-batches, distinct paths "
        f"{sorted({tuple(p) for p in skip_paths.tolist()})}", flush=True)
  cfg = trainers["skippipe"].model_cfg

  splits = pipeline.load_splits("stdlib")
  evals = pipeline.eval_batches(splits.eval, _SEQ_LEN.value, 16, eval_n)
  runs = {}
  for name, trainer in trainers.items():
    print(f"training {name} for {steps} steps", flush=True)
    t0 = time.perf_counter()
    final = hooks.FinalState()
    summary = trainer.run(hooks=[final])
    rows = [json.loads(l) for l in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    runs[name] = {"graphdef": trainer.graphdef,
                  "params": trainer.source.eval_params(final.state),
                  "train_loss": [(r["step"], r["loss"]) for r in rows if "loss" in r],
                  "eval": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r],
                  "seconds": time.perf_counter() - t0, "summary": summary}

  results = {
      "command": "python experiments/skippipe.py "
                 "--workdir=... " + ("--quick " if _QUICK.value else "")
                 + f"--steps={_STEPS.value}",
      "setup": {"model": "small", "num_layers": cfg.num_layers, "num_stages": num_stages,
                "layers_per_stage": lps, "d_model": cfg.d_model, "corpus": "stdlib",
                "seq_len": _SEQ_LEN.value, "microbatch_size": mb_size,
                "num_microbatches": len(skip_paths), "steps": steps, "learning_rate": _LR.value,
                "optimizer": "AdamW b=(0.9, 0.999) wd 0, clip 1.0, warm-up + cosine to 0.1x",
                "topology": "gcp_12_regions, our placement (seed "
                            f"{_SEED.value}), path_length 4 of 6 (33% skipped)",
                "skip_paths": skip_paths.tolist(), "schedule_seconds": schedule_s,
                "eval_tokens": int(evals[..., 1:].size)},
  }
  for name, run in runs.items():
    g, p = run["graphdef"], run["params"]
    full_loss = run["eval"][-1][1]
    removed = {r: _summary(training.stage_removal_losses(g, p, evals, num_stages, lps, r))
               for r in (1, 2, 3)}
    results[name] = {
      "train_loss": run["train_loss"],
      "eval_curve": run["eval"],
      "train_seconds": run["seconds"],
      "workdir": str(workdir / name),
      "eval_loss_all_layers": full_loss,
      "eval_ppl_all_layers": float(np.exp(full_loss)),
      "stages_removed": {str(r): v for r, v in removed.items()},
      "half_model_ppl_mean": float(np.exp(removed[3]["mean_loss"])),
      "half_model_ppl_increase_pct": float(100 * (np.exp(removed[3]["mean_loss"] - full_loss) - 1)),
      # layers run per micro-batch relative to the full pipeline: the compute each run spends.
      "relative_layer_compute": float(
        skip_paths.shape[1] / num_stages if name == "skippipe" else 1.0
      ),
    }
    print(f"{name}: eval loss {full_loss:.4f} (ppl {np.exp(full_loss):.3f}); half model ppl "
          f"{results[name]['half_model_ppl_mean']:.3f} "
          f"(+{results[name]['half_model_ppl_increase_pct']:.1f}%)", flush=True)
  results["skip_vs_full_eval_loss_pct"] = float(
    100
    * (results["skippipe"]["eval_loss_all_layers"] / results["full"]["eval_loss_all_layers"] - 1)
  )

  (workdir / "metrics.json").write_text(json.dumps(results, indent=1))
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for name, run in runs.items():
    axes[0].plot(*zip(*run["train_loss"]), label=name)
    axes[1].plot(*zip(*run["eval"]), marker="o", label=f"{name} (all layers)")
  axes[0].set(xlabel="step", ylabel="train loss (path, logged steps)", title="training loss")
  axes[1].set(xlabel="step", ylabel="eval loss, all layers in order", title="held-out loss")
  for ax in axes:
    ax.legend()
  fig.tight_layout()
  fig.savefig(workdir / "loss_curves.png", dpi=110)
  if _WRITE_RESULTS.value:
    (_RESULTS / "skippipe_training.json").write_text(json.dumps(results, indent=1))
    fig.savefig(_RESULTS / "skippipe_training.png", dpi=110)
  print(json.dumps({k: results[k] for k in ("skip_vs_full_eval_loss_pct",)}))


if __name__ == "__main__":
  cli.run(main)
