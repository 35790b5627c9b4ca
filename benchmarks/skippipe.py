"""SkipPipe's iteration time against the full pipeline and network-blind skipping.

  python benchmarks/skippipe.py
  python benchmarks/skippipe.py --placement_iterations=8000 --blind_seeds=10

On the reference implementation's 12-region GCP cluster (20 nodes, stages
[5,3,3,3,3,3], 4 of 6 stages visited = 33% skipped, 6 micro-batches per data
node) it plans one iteration with each method and plays it out in the
event-driven simulator, with the reference simulator's 0.13 s per-task gap:

  * full pipeline (DT-FM): 3 pipelines; the reference's own run (9
    micro-batches each, 27 in all) and an equal-work one (30);
  * network-blind skipping (DT-FM-skip): paths planned on uniform costs;
  * SkipPipe without TC2: load-balanced paths, no collision step;
  * SkipPipe: the collision-aware conflict-based search.

It prints them next to the simulated times stored in the reference's
schedule.json (79.9 / 48.9 / 35.4 / 33.3 s), first on the reference's own
node placement, then on ours, then with the NL-London bandwidth typo fixed,
then on the 42-node preset (8 stages, 6 of 8 visited = 25% skipped). The
pipeline time is what the reference reports; the iteration time adds each
stage's ring all-reduce of its 1.35 GB of gradients. Scheduler run times are
wall-clock on this machine. Writes benchmarks/results/skippipe.json and a
Gantt chart, benchmarks/results/skippipe_gantt.png.
"""

import dataclasses
import json
import os
import time

import numpy as np
from absl import app, flags

_PLACEMENT_ITERATIONS = flags.DEFINE_integer(
    "placement_iterations", 3000, "Annealing steps of the placement search.")
_BLIND_SEEDS = flags.DEFINE_integer(
    "blind_seeds", 5, "Seeds of network-blind skipping (mean and range).")
_TASK_GAP = flags.DEFINE_float(
    "task_gap_s", 0.13, "Busy time after each task (reference simulator: 0.13).")
_OUT = flags.DEFINE_string(
    "out", os.path.join(os.path.dirname(__file__), "results", "skippipe.json"),
    "JSON output path.")

# schedule.json of gensyn-ai/skippipe (simulated, same 12-region setup).
REFERENCE_S = {"full_pipeline_reference_setup": 79.93971963540922,
               "network_blind": 48.915682705668054,
               "skippipe_no_tc2": 35.43481420147051,
               "skippipe": 33.31379002209655}


def _timed(fn, *args, **kwargs):
  started = time.perf_counter()
  out = fn(*args, **kwargs)
  return out, time.perf_counter() - started


def run_setup(name, topo, placement, config, sim_config, blind_seeds,
              reference=None, reference_paths=None):
  """Every method on one topology and placement; returns rows and results."""
  from lowcomm_jax.skippipe import baselines, paths as paths_lib, scheduler, simulator

  def simulate(schedule):
    return simulator.simulate_iteration(topo, placement, schedule, sim_config)

  num_pipelines = min(len(nodes) for nodes in placement)
  # The reference plans its collision-aware paths one per data node
  # (schedule.json) but its load-only and random baselines with 3 per data
  # node; we do the same, and add SkipPipe with one path per micro-batch.
  streams = dataclasses.replace(
      config, paths_per_data_node=config.microbatches_per_data_node // 2)
  per_microbatch = dataclasses.replace(
      config, paths_per_data_node=config.microbatches_per_data_node)
  methods = {}
  if reference is not None:
    # The reference's own baseline: 9 micro-batches down each pipeline.
    methods["full_pipeline_reference_setup"] = _timed(
        baselines.full_pipeline_schedule, topo, placement, config,
        total_microbatches=9 * num_pipelines)
  methods["full_pipeline"] = _timed(baselines.full_pipeline_schedule, topo,
                                    placement, config)
  # Planning on uniform costs ties everywhere, so its searches are cut
  # short: any load-feasible paths will do for a network-blind baseline.
  blind_budget = scheduler.SearchBudget(root_orderings=2, max_solutions=1,
                                        max_cbs_nodes=30,
                                        max_path_expansions=2000)
  blind = [_timed(baselines.network_blind_schedule, topo, placement, streams,
                  seed=seed, budget=blind_budget)
           for seed in range(blind_seeds)]
  small = scheduler.SearchBudget(root_orderings=4, max_cbs_nodes=150)
  methods["skippipe_no_tc2"] = _timed(scheduler.skippipe_schedule, topo,
                                      placement, streams,
                                      collision_aware=False,
                                      score_config=sim_config)
  methods["skippipe"] = _timed(scheduler.skippipe_schedule, topo, placement,
                               config, score_config=sim_config)
  methods["skippipe_3_paths_per_node"] = _timed(
      scheduler.skippipe_schedule, topo, placement, streams,
      score_config=sim_config, budget=small)
  methods["skippipe_path_per_microbatch"] = _timed(
      scheduler.skippipe_schedule, topo, placement, per_microbatch,
      score_config=sim_config, budget=small)
  results = {key: (simulate(schedule), seconds, schedule)
             for key, (schedule, seconds) in methods.items()}
  blind_results = [(simulate(schedule), seconds) for schedule, seconds in blind]
  full_s = results["full_pipeline"][0].pipeline_time_s
  rows = []

  def add(key, label, pipeline_s, iteration_s, scheduler_s, extra=None):
    rows.append(dict(setup=name, method=key, label=label,
                     pipeline_s=pipeline_s, iteration_s=iteration_s,
                     vs_full_pipeline=pipeline_s / full_s - 1.0,
                     scheduler_s=scheduler_s,
                     reference_s=(reference or {}).get(key), **(extra or {})))

  labels = {"full_pipeline_reference_setup":
                f"full pipeline, {9 * num_pipelines} mb (ref. setup)",
            "full_pipeline": "full pipeline (DT-FM), equal work",
            "skippipe_no_tc2": "SkipPipe without TC2",
            "skippipe": "SkipPipe (collision-aware)",
            "skippipe_3_paths_per_node": "SkipPipe, 3 paths per data node",
            "skippipe_path_per_microbatch": "SkipPipe, 1 path per micro-batch"}
  for key in labels:
    if key not in results:
      continue
    result, seconds, schedule = results[key]
    add(key, labels[key], result.pipeline_time_s, result.iteration_time_s,
        seconds, {k: v for k, v in schedule.stats.items()
                  if k in ("chosen", "best_cbs_simulated_s",
                           "cbs_nodes_expanded")})
    if key == "full_pipeline":
      times = [r.pipeline_time_s for r, _ in blind_results]
      add("network_blind", f"network-blind skip, median of {blind_seeds}",
          float(np.median(times)),
          float(np.median([r.iteration_time_s for r, _ in blind_results])),
          float(np.mean([s for _, s in blind_results])),
          dict(pipeline_s_min=min(times), pipeline_s_max=max(times),
               pipeline_s_mean=float(np.mean(times)),
               pipeline_s_per_seed=times))
  if reference_paths is not None:
    result = simulate(paths_lib.Schedule(paths=reference_paths))
    add("reference_paths", "reference's SkipPipe paths, our simulator",
        result.pipeline_time_s, result.iteration_time_s, None)
  return rows, results


def _reference_paths():
  """The reference's 5 collision-aware paths, 6 micro-batches each, released
  as its create_schedule.py does (3 per wave 1 s apart, waves 2.5 s apart)."""
  from lowcomm_jax.skippipe import paths as paths_lib, topology as topology_lib
  stored = topology_lib.reference_data()["reported_results"][
      "schedule_json_collision_aware_paths"]
  out = []
  for entry in stored.values():
    for i in range(6):
      out.append(paths_lib.MicrobatchPath(
          len(out), tuple(entry["stages"]),
          tuple(entry["node_sequence_then_back_to_first"]),
          release_s=(i % 2) * 2.5 + (i // 2) * 1.0))
  return tuple(out)


def main(argv):
  del argv
  from lowcomm_jax.skippipe import gantt, paths, placement, simulator, topology as topology_lib

  sim_config = simulator.SimulationConfig(task_gap_s=_TASK_GAP.value)
  blind_seeds = _BLIND_SEEDS.value
  config12 = paths.SkipConfig(path_length=4, microbatches_per_data_node=6)
  config42 = paths.SkipConfig(path_length=6, microbatches_per_data_node=6)
  gcp = topology_lib.gcp_12_regions()
  gcp_fixed = topology_lib.gcp_12_regions(fix_nl_london=True)
  big = topology_lib.gcp_42_nodes()
  rows, placement_s = [], {}
  # As stored: node j of each stage is the reference baseline's pipeline j.
  reference_placement = topology_lib.reference_placement_12_regions()
  setups = [("12 regions, reference placement", gcp, reference_placement,
             config12, REFERENCE_S, _reference_paths())]
  for name, topo, config in (("12 regions, our placement", gcp, config12),
                             ("12 regions, NL-London fixed, our placement",
                              gcp_fixed, config12),
                             ("42 nodes, our placement", big, config42)):
    placed, seconds = _timed(placement.optimize_placement, topo, seed=0,
                             iterations=_PLACEMENT_ITERATIONS.value)
    placement_s[name] = seconds
    setups.append((name, topo, placed, config, None, None))
  gantt_inputs = None
  for name, topo, placed, config, reference, ref_paths in setups:
    setup_rows, results = run_setup(name, topo, placed, config, sim_config,
                                    blind_seeds, reference, ref_paths)
    rows += setup_rows
    if gantt_inputs is None:
      gantt_inputs = (topo, placed, results)

  print(f"SkipPipe iteration time (simulated, {_TASK_GAP.value:g} s task gap);"
        f" pipeline = last backward done, +all-reduce = with the intra-stage "
        f"ring all-reduce")
  for name in dict.fromkeys(r["setup"] for r in rows):
    print(f"\n{name}" + (f" (placement search {placement_s[name]:.1f} s)"
                         if name in placement_s else ""))
    print(f"{'method':<42} {'pipeline s':>10} {'vs full':>8} {'reference s':>11}"
          f" {'+all-reduce s':>13} {'scheduler s':>11}")
    for r in rows:
      if r["setup"] != name:
        continue
      ref = f"{r['reference_s']:.1f}" if r["reference_s"] else "-"
      sched = f"{r['scheduler_s']:.3f}" if r["scheduler_s"] is not None else "-"
      spread = (f" [{r['pipeline_s_min']:.1f}-{r['pipeline_s_max']:.1f}]"
                if "pipeline_s_min" in r else "")
      print(f"{r['label'] + spread:<42} {r['pipeline_s']:>10.1f} "
            f"{100 * r['vs_full_pipeline']:>+7.0f}% {ref:>11} "
            f"{r['iteration_s']:>13.1f} {sched:>11}")
  print("\nreference (schedule.json): full 79.9, random skip 48.9, without "
        "TC2 35.4, SkipPipe 33.3 s; paper: up to 55% below the full pipeline")

  out_dir = os.path.dirname(os.path.abspath(_OUT.value))
  os.makedirs(out_dir, exist_ok=True)
  topo, placed, results = gantt_inputs
  import matplotlib.pyplot as plt
  figure, axes = plt.subplots(2, 1, figsize=(13, 13), sharex=True)
  for ax, key in zip(axes, ("full_pipeline_reference_setup", "skippipe")):
    result = results[key][0]
    gantt.plot_gantt(topo, placed, result, ax=ax, show_allreduce=False,
                     title=f"{key}: {result.pipeline_time_s:.1f} s")
  png = os.path.join(out_dir, "skippipe_gantt.png")
  figure.savefig(png, dpi=90, bbox_inches="tight")
  with open(_OUT.value, "w") as f:
    json.dump(dict(task_gap_s=_TASK_GAP.value, blind_seeds=blind_seeds,
                   placement_iterations=_PLACEMENT_ITERATIONS.value,
                   placement_search_s=placement_s, reference_s=REFERENCE_S,
                   rows=rows), f, indent=1)
  print(f"wrote {_OUT.value} and {png}")
  _print_training_comparison()


def _print_training_comparison() -> None:
  """The training half of the benchmark, from `experiments/skippipe.py`'s results file."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                      "skippipe_training.json")
  if not os.path.exists(path):
    print("no training results yet: run python experiments/skippipe.py")
    return
  with open(path) as f:
    result = json.load(f)
  print(f"\ntraining at equal steps ({result['command']}):")
  print(f"{'trained on':<16}{'eval loss, all stages':>22}{'ppl, all':>10}{'ppl, half model':>17}"
        f"{'half vs all':>13}")
  for name in ("skippipe", "full"):
    r = result[name]
    print(f"{name:<16}{r['eval_loss_all_layers']:>22.4f}{r['eval_ppl_all_layers']:>10.2f}"
          f"{r['half_model_ppl_mean']:>17.2f}{r['half_model_ppl_increase_pct']:>12.1f}%")
  print(f"skip-trained vs full-trained eval loss: {result['skip_vs_full_eval_loss_pct']:+.1f}%")


if __name__ == "__main__":
  app.run(main)
