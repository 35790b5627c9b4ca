"""A recorded sweep of one bench entry's hyperparameters, at one scale of benchmarks/bench.py.

  python benchmarks/sweep.py --scale=quick --entry=diloco_m2 \
      --grid="outer_optimizer.learning_rate=0.4,0.7,1.0;outer_optimizer.momentum=0.5,0.9"

Every point of the grid (the cartesian product of each key's values, config keys as the command
line's `--config.<key>`) is the entry's changes with the point's on top, trained on the scale's task
as bench.py trains an entry (same tokens, steps, evaluations and declared step time) for --seeds
seeds, each in its own workdir. The record, benchmarks/entries/<entry>.sweep_<scale>.json, holds
the grid, every (point, seed) with its final eval loss, steps to the task's target and simulated
seconds to it on each link, and the best point (lowest mean final eval loss): the entry's
settings should be that point, and its docstring says so. Each finished run is written at once, so
rerunning the command trains only what is missing; a point equal to the entry's own settings is
read from bench_<scale>.json where bench.py already ran it. A grid that does not parse, an unknown
entry, key or value is refused in one line before anything trains.
"""

import itertools
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top,wrong-import-position

_HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(_HERE))
import bench  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402


def parse_grid(text: str) -> dict[str, list]:
  """"key=v1,v2;key2=v3" -> {key: [v1, v2], key2: [v3]}: values as JSON where they parse (numbers,
  true/false), else strings. Raises ValueError naming --grid."""
  grid = {}
  for part in (p.strip() for p in text.split(";") if p.strip()):
    key, sep, values = part.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
      raise ValueError(f"--grid: {part!r} is not key=value[,value...] (keys separated by ';')")
    grid[key.strip()] = [_value(v) for v in items]
  if not grid:
    raise ValueError("--grid: empty; give key=value[,value...] with keys separated by ';'")
  return grid


def _value(text: str):
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def points(grid: dict[str, list]) -> list[dict]:
  """Every combination of the grid's values, the first key varying slowest."""
  return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def point_name(point: dict) -> str:
  return ",".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())


def check(task, entry: str, grid: dict) -> dict:
  """The entry's changes; every point's config checked (one ValueError line) before any run."""
  from lowcomm_jax.train import validation  # pylint: disable=g-import-not-at-top
  if entry not in bench.entry_names():
    raise ValueError(f"--entry: no entry {entry!r}; allowed: {', '.join(bench.entry_names())}")
  base = bench.load_entry(entry).changes(task)
  for point in points(grid):
    try:
      validation.validate(bench.make_config(task, {**base, **point}, 0, 1))
    except (KeyError, AttributeError) as error:
      raise ValueError(f"--grid: {point_name(point)}: no config key {error}") from None
  return base


def summarize(record: dict) -> dict | None:
  """The best point: the lowest mean final eval loss over its seeds (None before any run)."""
  by_point = {}
  for run in record["runs"]:
    by_point.setdefault(json.dumps(run["point"], sort_keys=True), []).append(run)
  if not by_point:
    return None
  means = {k: statistics.mean(r["final_eval_loss"] for r in runs) for k, runs in by_point.items()}
  best = min(means, key=means.get)
  return {"point": json.loads(best), "mean_final_eval_loss": means[best],
          "seeds": len(by_point[best])}


def sweep(scale: str, entry: str, grid: dict, seeds: int, workdir: pathlib.Path,
          out: pathlib.Path, results_dir: pathlib.Path) -> int:
  """Runs the (point, seed) pairs not yet in `out`, each recorded once finished; returns how many
  it trained."""
  task = bench.TASKS[scale]
  base = check(task, entry, grid)
  record = json.loads(out.read_text()) if out.exists() else {}
  if record.get("grid") != grid or record.get("scale") != scale:  # another sweep: start anew
    record = {"entry": entry, "scale": scale, "grid": grid, "runs": []}
  done = {(json.dumps(r["point"], sort_keys=True), r["seed"]) for r in record["runs"]}
  benched = _bench_runs(results_dir / f"bench_{scale}.json", entry)
  trained = 0
  for point in points(grid):
    changes = {**base, **point}
    for seed in range(seeds):
      if (json.dumps(point, sort_keys=True), seed) in done:
        continue
      run = benched.get(seed) if changes == base else None
      if run is None:
        print(f"== {entry} {point_name(point)} seed {seed} at "
              f"{time.strftime('%H:%M:%S', time.gmtime())} UTC", flush=True)
        run = bench.run_one(task, entry, seed, workdir / scale / entry / point_name(point) /
                            f"seed{seed}", changes=changes)
        trained += 1
      record["runs"].append(_row(task, point, seed, run))
      record["best"] = summarize(record)
      record["command"] = " ".join(["python", "benchmarks/sweep.py", *sys.argv[1:]])
      record["date"] = time.strftime("%Y-%m-%d", time.gmtime())
      out.write_text(json.dumps(record, indent=1) + "\n")
  return trained


def _bench_runs(path: pathlib.Path, entry: str) -> dict:
  """bench.py's runs of `entry` by seed (its own settings), if it recorded any."""
  if not path.exists():
    return {}
  return {r["seed"]: r for r in json.loads(path.read_text())["runs"] if r["entry"] == entry}


def _row(task, point: dict, seed: int, run: dict) -> dict:
  scored = bench.score(run, task.target_loss)
  return {"point": point, "seed": seed, "final_eval_loss": run["final_eval_loss"],
          "steps_to_target": scored["steps_to_target"],
          "seconds_to_target": None if scored["links"] is None else
          {link: cell["seconds"] for link, cell in scored["links"].items()},
          "workdir": run["workdir"]}


def define_flags() -> dict:
  """The command's flags (defined by the command only: the module's functions import alone)."""
  return {
      "scale": flags.DEFINE_string("scale", "quick", f"Task scale: {' | '.join(bench.TASKS)}."),
      "entry": flags.DEFINE_string("entry", "", "The entry (a file in benchmarks/entries/)."),
      "grid": flags.DEFINE_string("grid", "", "key=v1,v2;key2=v3,...: config keys and values."),
      "seeds": flags.DEFINE_integer("seeds", 1, "Seeds per point."),
      "workdir": flags.DEFINE_string("workdir", "runs/sweeps", "Where the runs live."),
      "out": flags.DEFINE_string("out", "", "The record (default: benchmarks/entries/"
                                 "<entry>.sweep_<scale>.json)."),
      "results_dir": flags.DEFINE_string("results_dir", str(_HERE / "results"), "Where "
                                         "bench_<scale>.json is read from (the entry's own runs)."),
  }


def main(argv, flag: dict):
  del argv
  logging.set_verbosity(logging.WARNING)
  scale, entry, seeds = flag["scale"].value, flag["entry"].value, flag["seeds"].value
  try:
    if scale not in bench.TASKS:
      raise ValueError(f"--scale: {scale!r} is not a scale; allowed: {', '.join(bench.TASKS)}")
    if seeds < 1:
      raise ValueError(f"--seeds: must be >= 1, got {seeds}")
    grid = parse_grid(flag["grid"].value)
    check(bench.TASKS[scale], entry, grid)
  except ValueError as error:
    print(str(error).splitlines()[0], file=sys.stderr)
    sys.exit(2)
  out = pathlib.Path(flag["out"].value or bench.ENTRIES_DIR / f"{entry}.sweep_{scale}.json")
  trained = sweep(scale, entry, grid, seeds, pathlib.Path(flag["workdir"].value), out,
                  pathlib.Path(flag["results_dir"].value))
  record = json.loads(out.read_text())
  for run in record["runs"]:
    print(f"{point_name(run['point']):40s} seed {run['seed']}: final eval loss "
          f"{run['final_eval_loss']:.4f}, steps to target {run['steps_to_target']}")
  best = record["best"]
  print(f"best: {point_name(best['point'])} ({best['mean_final_eval_loss']:.4f}); trained "
        f"{trained}; recorded in {out}")


if __name__ == "__main__":
  _FLAGS = define_flags()
  app.run(lambda argv: main(argv, _FLAGS))
