"""Learners of different speeds: synchronous DiLoCo, elastic rounds that drop or down-weight the
slow learner's Δ, and asynchronous learners (Delayed Nesterov, DyLU from the declared speeds)
under each staleness rule, in real wall time on this machine.

  python benchmarks/async_learners.py                      # tiny, 4 learners at 1, 1, 1/2, 1/4
  python benchmarks/async_learners.py --steps=400 --variant=small
  python benchmarks/async_learners.py --rules=inverse,heloco   # with HeLoCo's alignment

Each row is one elastic run (lowcomm_jax.elastic.run, a local Ray on 127.0.0.1) of
experiments/configs/elastic.py:<variant> with `--steps` steps, H = the variant's, learners slowed by
`--speeds` for the whole run (`elastic.speeds`):

  synchronous      every round waits for every learner (min_quorum = all)
  elastic drop     rounds close with 3 of 4 and the grace window (adaptive); a late Δ dropped
  elastic weight   the same, a late Δ merged with weight 0.5^(rounds behind)
  async <rule>     elastic.asynchronous, outer_optimizer.momentum_every = learners, local_steps =
                   by_speed (learner i syncs every H·s_i/max s of its steps), staleness <rule>

Per row: φ's eval loss at the end, the wall time (first learner start to the last merge), tokens
merged into φ, and φ's eval loss at the asynchronous rows' median wall time (every saved φ of the
syncer is kept; the one saved last before that moment is evaluated): "at equal wall time"; and
each row's final loss against the synchronous run's φ after the first round by which it had merged
as many tokens: "at equal tokens merged".

Writes benchmarks/results/async_learners.json.
"""

from __future__ import annotations

import datetime
import json
import math
import pathlib
import statistics
import sys
import tempfile

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]

_STEPS = flags.DEFINE_integer("steps", 300, "Steps of the fastest learner (num_steps).")
_VARIANT = flags.DEFINE_enum("variant", "tiny", ["tiny", "small"], "experiments/configs/elastic.py")
_SPEEDS = flags.DEFINE_string("speeds", "1,1,0.5,0.25", "elastic.speeds (one per learner).")
_RULES = flags.DEFINE_list("rules", ["inverse", "cutoff", "none"], "Staleness rules of the "
                           "asynchronous rows (elastic.staleness: inverse, cutoff, none, heloco).")
_TIMEOUT = flags.DEFINE_float("timeout_s", 3000.0, "elastic.timeout_s of each run.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Folder of the runs (default: a temporary one).")
_OUT = flags.DEFINE_string("out", str(ROOT / "benchmarks" / "results" / "async_learners.json"),
                           "JSON output path.")


def _variants(learners: int) -> list[tuple[str, dict]]:
  elastic_rounds = {"elastic.min_quorum": learners - 1, "elastic.grace_s": 1.0,
                    "elastic.adaptive_grace": True}
  rows = [("synchronous", {"elastic.min_quorum": 0}),
          ("elastic drop", {**elastic_rounds, "elastic.late": "drop"}),
          ("elastic weight", {**elastic_rounds, "elastic.late": "weight"})]
  for rule in _RULES.value:
    rows.append((f"async {rule}", {"elastic.asynchronous": True, "elastic.staleness": rule,
                                   "outer_optimizer.momentum_every": learners,
                                   "elastic.local_steps": "by_speed"}))
  return rows


def _saved_phis(work: pathlib.Path, summary: dict) -> list[tuple[float, int]]:
  """(seconds since the run's first learner started, the syncer's save holding φ then) per closed
  round or merge: save 1 is φ_0, each round or merge saves once more (in order)."""
  start = min(ev["time"] for evs in summary["events"] for ev in evs)
  return [(r["time"] - start, k + 2) for k, r in enumerate(summary["round_log"])]


def _loss_at(config, work: pathlib.Path, summary: dict, seconds: float) -> float:
  """φ's eval loss as the syncer had it `seconds` after the run started."""
  save = 1
  for t, k in _saved_phis(work, summary):
    if t <= seconds:
      save = k
  return _loss_of_save(config, work, save)


def _loss_at_tokens(config, work: pathlib.Path, summary: dict, tokens: float) -> float:
  """A run of rounds (every round merges the same tokens): φ's eval loss after the first round
  by which `tokens` were merged."""
  per_round = summary["tokens_merged"] / len(summary["round_log"])
  rounds = min(max(math.ceil(tokens / per_round - 1e-9), 1), len(summary["round_log"]))
  return _loss_of_save(config, work, rounds + 1)


def _loss_of_save(config, work: pathlib.Path, save: int) -> float:
  """The eval loss of φ in the syncer's save `save` (1: φ_0)."""
  import jax  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.elastic import options, syncer  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train.trainer import Trainer  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as scratch:
    trainer = Trainer(options.evaluation_config(config), pathlib.Path(scratch) / "eval",
                      jax.devices()[:1])
    phi = checkpoint.read_step(work / "syncer", save)["phi"]
    return syncer.evaluate(config, trainer, phi, trainer.init_params())[0]


def main(argv):
  del argv
  import elastic_runs  # pylint: disable=g-import-not-at-top (benchmarks/, beside this file)
  learners = len(_SPEEDS.value.split(","))
  base = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="async-learners-"))
  runs = []
  for name, changes in _variants(learners):
    config = elastic_runs.config(
        _STEPS.value, learners, 0.0, _TIMEOUT.value, _VARIANT.value,
        **{"elastic.speeds": _SPEEDS.value, "checkpoint.keep": 100_000, **changes})
    work = base / name.replace(" ", "_")
    summary = elastic_runs.run(config, work)
    saved = _saved_phis(work, summary)
    runs.append((name, config, work, summary, saved[-1][0] if saved else summary["wall_time_s"]))
    print(f"{name}: eval loss {summary['final_eval_loss']:.4f}, {runs[-1][4]:.1f} s", flush=True)
  async_times = [t for name, *_, t in runs if name.startswith("async")]
  equal_time = statistics.median(async_times) if async_times else None
  rows = []
  for name, config, work, summary, seconds in runs:
    rows.append({
        "run": name, "eval_loss": summary["final_eval_loss"], "wall_time_s": seconds,
        "tokens_merged": summary["tokens_merged"], "tokens_computed": summary["tokens_computed"],
        "goodput": summary["goodput"],
        "eval_loss_at_equal_time": (_loss_at(config, work, summary, equal_time)
                                    if equal_time is not None else None),
        "merges_or_rounds": len(summary["round_log"]),
        "learner_steps": summary["learner_steps"]})
  sync = rows[0]
  _, sync_config, sync_work, sync_summary, _ = runs[0]
  for row in rows:
    row["vs_synchronous_at_equal_time"] = (row["eval_loss_at_equal_time"] /
                                           sync["eval_loss_at_equal_time"] - 1)
    row["vs_synchronous_final"] = row["eval_loss"] / sync["eval_loss"] - 1
    # the synchronous run when it had merged as many tokens as this row in all
    row["synchronous_at_equal_tokens"] = _loss_at_tokens(sync_config, sync_work, sync_summary,
                                                         row["tokens_merged"])
    row["vs_synchronous_at_equal_tokens"] = (row["eval_loss"] /
                                             row["synchronous_at_equal_tokens"] - 1)
  out = {"date": datetime.date.today().isoformat(), "variant": _VARIANT.value,
         "steps": _STEPS.value, "speeds": _SPEEDS.value, "learners": learners,
         "equal_time_s": equal_time, "command": " ".join(["python", *sys.argv]), "rows": rows}
  pathlib.Path(_OUT.value).write_text(json.dumps(out, indent=1) + "\n")
  print(f"{'run':16s} {'loss':>7s} {'wall s':>7s} {'tokens':>9s} {'loss@t':>7s} {'Δ@t':>7s} "
        f"{'Δ@tokens':>9s}")
  for r in rows:
    print(f"{r['run']:16s} {r['eval_loss']:7.4f} {r['wall_time_s']:7.1f} "
          f"{r['tokens_merged']:9.0f} {r['eval_loss_at_equal_time']:7.4f} "
          f"{100 * r['vs_synchronous_at_equal_time']:+6.2f}% "
          f"{100 * r['vs_synchronous_at_equal_tokens']:+8.2f}%")


if __name__ == "__main__":
  app.run(main)
