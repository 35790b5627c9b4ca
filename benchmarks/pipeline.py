"""The pipeline executor's bubble against the simulator's, and NoLoCo vs DiLoCo with a pipeline
inside.

  python benchmarks/pipeline.py                 # both parts, about 10 minutes on 2 CPU cores
  python benchmarks/pipeline.py --steps=0       # the bubble table only

Part 1 (8 fake CPU devices, the `tiny` model at 1 layer per stage): for the full pipeline in GPipe
and 1F1B order, a SkipPipe schedule (the scheduler's per-micro-batch paths on a random 4-stage ×
2-replica cluster) and NoLoCo's random routing, it compiles the tick table, runs it with the
executor and prints each schedule's ticks and idle device-ticks: measured in the program, planned
by the tick compiler and predicted by the SkipPipe simulator with unit costs (forward, loss and
backward one tick each, links free).

Part 2: `experiments/configs/noloco_pipeline.py` trained three ways at equal tokens (2 stages × 4
replicas, random routing): NoLoCo, DiLoCo (the paper's baseline: all-reduce every 100 steps, outer
Nesterov 0.7/0.3) and NoLoCo with fixed routing; eval loss (fixed routing, mean of the replicas' own
models) and the replicas' weight spread.

Writes benchmarks/results/pipeline.json.
"""

import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position

_STEPS = flags.DEFINE_integer("steps", 600, "Training steps of each part-2 run (0: skip part 2).")
_OUT = flags.DEFINE_string("out",
                           os.path.join(os.path.dirname(__file__), "results", "pipeline.json"),
                           "JSON output path.")


def bubble_cases():
  from lowcomm_jax.parallel import bubble, routing  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.skippipe import paths, scheduler, topology  # pylint: disable=g-import-not-at-top
  topo = topology.random_heterogeneous(1, (2,) * 4, layers_per_stage=1)
  placement = bubble.grid_placement(4, 2)
  skip = scheduler.skippipe_schedule(topo, placement, paths.SkipConfig(
      path_length=3, microbatches_per_data_node=3, paths_per_data_node=3))
  skip_routes = routing.routes_from_skippipe(skip, placement)
  return [
      # name, stages, replicas, routes, order
      ("full pipeline, GPipe (S=4, R=2, 6 mb/replica)", 4, 2, routing.full_pipeline_routes(6, 4, 2),
       "gpipe"),
      ("full pipeline, 1F1B (S=4, R=2, 6 mb/replica)", 4, 2, routing.full_pipeline_routes(6, 4, 2),
       "1f1b"),
      ("SkipPipe paths, GPipe order (S=4, R=2, 3 of 4 stages)", 4, 2, skip_routes, "gpipe"),
      ("SkipPipe paths, 1F1B order (S=4, R=2, 3 of 4 stages)", 4, 2, skip_routes, "1f1b"),
      ("random routing, GPipe (S=2, R=4, 6 slots)", 2, 4, routing.random_routes(6, 2, 4, seed=0),
       "gpipe"),
      ("random routing, GPipe (S=4, R=2, 6 slots)", 4, 2, routing.random_routes(6, 4, 2, seed=0),
       "gpipe"),
  ]


def measure_bubbles():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.models import get_model_config, llama  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.parallel import bubble, stages, ticks  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.parallel.executor import PipelineExecutor  # pylint: disable=g-import-not-at-top

  rows = []
  for name, s, r, routes, order in bubble_cases():
    cfg = get_model_config("tiny", num_layers=s)
    params_R = jax.tree.map(lambda x: jnp.broadcast_to(x, (r,) + x.shape),
                            llama.init_params(cfg, 0))
    table = ticks.compile_ticks(routes, s, r, order)
    memory = len(routes) if order == "gpipe" else s
    batch = np.random.default_rng(0).integers(0, 256, (len(routes), 2, 17))
    result = PipelineExecutor(stages.StageFunctions(cfg), table)(stages.to_grid(params_R, s), batch)
    makespan, simulated_idle = bubble.simulated_idle_ticks(table, memory)
    devices = s * r
    rows.append({
        "schedule": name, "order": order, "microbatches": len(routes),
        "ticks_measured": result.num_ticks, "makespan_simulated": makespan,
        "idle_measured": int(result.idle_ticks.sum()),
        "idle_planned": int(table.idle_ticks().sum()),
        "idle_simulated": int(simulated_idle.sum()),
        "bubble_measured": float(result.idle_ticks.sum() / (result.num_ticks * devices)),
        "bubble_simulated": float(simulated_idle.sum() / (makespan * devices)),
        "idle_per_device_measured": result.idle_ticks.tolist(),
        "idle_per_device_simulated": simulated_idle.tolist(),
        "port_waits": table.port_waits, "tick_table": table.text(),
    })
    row = rows[-1]
    print(f"{name:58s} ticks {row['ticks_measured']:3d} / {row['makespan_simulated']:3d}   idle "
          f"{row['idle_measured']:3d} / {row['idle_simulated']:3d}   bubble "
          f"{row['bubble_measured']:.3f} / {row['bubble_simulated']:.3f}   port waits "
          f"{row['port_waits']}", flush=True)
  return rows


def train_runs(steps):
  import importlib.util  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top

  import numpy as np  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.train import Trainer  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs",
                      "noloco_pipeline.py")
  spec = importlib.util.spec_from_file_location("noloco_pipeline", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  runs = {}
  for variant, label in (("", "NoLoCo + pipeline (random routing)"),
                         ("diloco", "DiLoCo + pipeline (random routing)"),
                         ("fixed", "NoLoCo + pipeline (fixed routing)")):
    c = module.get_config(variant)
    c.num_steps = steps
    c.eval.every = max(steps // 6, 1)
    c.checkpoint.every = steps
    c.progress_bar = False
    print(f"training {label}, {steps} steps", flush=True)
    workdir = tempfile.mkdtemp(prefix="pipeline_bench_")
    summary = Trainer(c, workdir).run()
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      metrics = [json.loads(line) for line in f]
    per_replica = summary.get("final_eval_loss_replicas")
    runs[label] = {
      "summary": summary,
      # The former loop's figure: the mean of the replicas' own models (fixed routing).
      "eval_loss_mean_of_replicas": float(np.mean(per_replica)) if per_replica else None,
      "eval_curve": [
        (m["step"], m["eval_loss"], m.get("weight_spread")) for m in metrics if "eval_loss" in m
      ],
      "command": "python experiments/train.py --config=experiments/configs/"
      f"noloco_pipeline.py{':' + variant if variant else ''} --workdir=... "
      f"--config.num_steps={steps}",
    }
  return runs


def main(argv):
  del argv
  started = time.perf_counter()
  print("schedule" + " " * 51 + "ticks meas/sim   idle meas/sim   bubble meas/sim")
  results = {
    "command": "python benchmarks/pipeline.py"
    + (f" --steps={_STEPS.value}" if _STEPS.value != 600 else ""),
    "bubble": measure_bubbles(),
  }
  if _STEPS.value:
    results["training"] = train_runs(_STEPS.value)
    print("\nrun                                   eval loss   weight spread   tokens")
    for label, run in results["training"].items():
      s = run["summary"]
      print(f"{label:38s} {s['final_eval_loss']:.4f}      {s.get('final_weight_spread', 0.0):.2e} "
            f"     {s['tokens']}")
  results["wall_seconds"] = time.perf_counter() - started
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
