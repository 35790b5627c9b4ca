"""Elastic learners through a Poisson fault schedule against the same run without faults, a
straggler under each grace window and late-Δ rule, a timeline of every learner, and the syncer's
round time against an in-program all-reduce.

  python benchmarks/elastic.py          # tiny, 4 learners, 1,500 steps, 360 kills per hour
  python benchmarks/elastic.py --steps=400 --faults_per_hour=200 --fault_free_runs=1
  python benchmarks/elastic.py --fault_free_runs=1 --small_steps=600   # also rows at `small`

Runs of experiments/configs/elastic.py:tiny with `--steps` steps (lowcomm_jax.elastic.run, a local
Ray on 127.0.0.1, one JAX compilation cache shared by all): `--fault_free_runs` without faults (the
first is the reference; a second shows how much an elastic run's loss varies with the order in
which learners arrive), then one with `elastic.faults_per_hour` Poisson kills of random learners
(`ray.kill` from the driver, from its start on; Ray restarts the actor).
Each row: goodput (tokens merged into φ ÷ tokens computed), participation (accepted Δ ÷ live
learners, mean over rounds), the median rejoin time (the driver seeing a death to the restarted
learner's `joined`) and where it went (`rejoin_phases`), φ's final eval loss and the fault-free
run's, faults fired (a kill while a learner still starts is a fault but no death), deaths, wall
time, tokens computed against the fault-free run (a dead learner's shard skips steps), seconds
per timeline kind summed over learners.

The round time: in the fault-free run, per round the learner whose Δ reached the syncer last
(latest `sync_begin`) and the seconds it waited for the syncer's reply (`sync_end`), median over
rounds. Against it: one all-reduce (mean over processes) of the same parameters, float32, in a
jax.distributed program of `learners` processes on 127.0.0.1 (gloo), one CPU device each, median
of `--allreduce_repeats` calls (this file run with --allreduce_worker).

The straggler rows (`--straggler_steps`, 0: none): learner N − 1 is `--straggler_factor` times
slower from its first step (`slow` fault), four runs: the fixed and the adaptive grace window
(`elastic.adaptive_grace`), each with late Δ dropped and merged with a staleness weight
(`elastic.late`); per row also the fast learners' median wait per round (sync_begin to sync_end)
and the grace window's mean wait per round (the syncer's round log).

The `small` rows (`--small_steps`, 0: none): experiments/configs/elastic.py:small without faults
and with the same Poisson kills.

Writes benchmarks/results/elastic.json (`rows`, each with its `scenario` and `variant`;
`round_time`) and elastic_timeline.png (per learner of each run: starting, training, syncing, dead,
healing).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

_STEPS = flags.DEFINE_integer("steps", 1500, "Steps of each run (tiny's own is 200).")
_LEARNERS = flags.DEFINE_integer("learners", 4, "elastic.num_learners.")
_RATE = flags.DEFINE_float("faults_per_hour", 360.0, "elastic.faults_per_hour of the faulty run.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 1500.0, "elastic.timeout_s of each run.")
_FREE_RUNS = flags.DEFINE_integer("fault_free_runs", 2, "Fault-free runs (a second one shows the "
                                  "run-to-run spread of an elastic run's loss).")
_REPEATS = flags.DEFINE_integer("allreduce_repeats", 30, "Timed all-reduce calls.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Folder of the runs (default: a temporary one).")
_OUT = flags.DEFINE_string("out", str(RESULTS / "elastic.json"), "JSON output path.")
_PLOT = flags.DEFINE_string("plot", str(RESULTS / "elastic_timeline.png"), "Timeline picture.")
_STRAGGLER_STEPS = flags.DEFINE_integer("straggler_steps", 1500, "Steps of each straggler run "
                                        "(0: no straggler rows).")
_STRAGGLER_FACTOR = flags.DEFINE_float("straggler_factor", 10.0, "How many times slower the "
                                       "straggler is.")
_SMALL_STEPS = flags.DEFINE_integer("small_steps", 0, "Steps of the `small` runs (0: none).")
_WORKER = flags.DEFINE_string("allreduce_worker", "", "Internal: process_id,num_processes,port,"
                              "shapes.json of one all-reduce process.")

KINDS = ("starting", "training", "syncing", "dead", "healing")


# -- the timeline (pure) ---------------------------------------------------------------------------

def intervals(
  events: list[dict], deaths: list[float], end: float
) -> list[tuple[str, float, float]]:
  """One learner's (kind, t0, t1) intervals from its events.jsonl and the times the driver saw it
  die: starting (the first start→joined), healing (every later start→joined), training
  joined→sync_begin and sync_end→next, syncing sync_begin→sync_end, dead death→the next start (a
  `kill` event is a death too). What is open at `end` closes there."""
  stream = sorted([(ev["time"], ev["event"]) for ev in events]
                  + [(t, "death") for t in deaths])
  out, kind, since = [], None, 0.0
  joined_since_death = True  # as the driver counts: one death per life that had joined

  def close(t):
    if kind is not None and t > since:
      out.append((kind, since, t))

  for t, event in stream:
    if event in ("death", "kill"):
      if joined_since_death and kind in ("starting", "healing"):
        # the driver saw the death after Ray had already restarted the learner: that death
        # ended the life before this start, whose end the events do not show
        joined_since_death = False
      elif joined_since_death:
        close(t)
        kind, since = "dead", t
        joined_since_death = False
    elif event == "start":
      close(t)
      kind, since = "healing" if out or kind == "dead" else "starting", t
    elif event in ("joined", "sync_end") and kind is not None and kind != "dead":
      joined_since_death = joined_since_death or event == "joined"
      close(t)
      kind, since = "training", t
    elif event == "sync_begin" and kind == "training":
      close(t)
      kind, since = "syncing", t
    elif event in ("finished", "removed") and kind is not None and kind != "dead":
      close(t)
      kind = None
  close(end)
  return out


def rejoin_phases(events: list[dict], death: float) -> dict | None:
  """Where one rejoin's seconds went, from the driver seeing the death: `restart` to the new
  process's `start` (Ray restarting the actor: a process, its imports; negative when Ray had
  restarted it before the driver noticed), `construct` start→ready (the Trainer, the data, a
  fresh state, the step program from the compilation cache), `called` ready→run (the driver's new
  `run` call), `heal` run→joined (φ and a peer's inner state); `from_last_event`: joined minus the
  dead life's last event, a bound from above on the time from the death itself (the driver notices
  it late). None when it did not rejoin."""
  events = sorted(events, key=lambda ev: ev["time"])
  joined_before = [k for k, ev in enumerate(events)
                   if ev["event"] == "joined" and ev["time"] <= death]
  first = joined_before[-1] + 1 if joined_before else 0
  starts = [k for k in range(first, len(events)) if events[k]["event"] == "start"]
  if not starts:
    return None
  marks = {}
  for ev in events[starts[0]:]:
    if ev["event"] in ("start", "ready", "run", "joined") and ev["event"] not in marks:
      marks[ev["event"]] = ev["time"]
    if ev["event"] == "joined":
      break
  if "joined" not in marks or starts[0] == 0:
    return None
  out, t = {}, death
  for name, event in (("restart", "start"), ("construct", "ready"), ("called", "run"),
                      ("heal", "joined")):
    if event in marks:
      out[name], t = marks[event] - t, marks[event]
  out["from_last_event"] = marks["joined"] - events[starts[0] - 1]["time"]
  return out


def last_arrival_waits(events_by_learner: list[list[dict]]) -> list[float]:
  """Per round (step, fragment): the seconds the learner whose `sync_begin` came last waited for
  its `sync_end`, in the order of the rounds' steps."""
  rounds = {}
  for events in events_by_learner:
    begun = {}
    for ev in events:
      key = (ev.get("step"), ev.get("fragment"))
      if ev["event"] == "sync_begin":
        begun[key] = ev["time"]
      elif ev["event"] == "sync_end" and key in begun:
        t0 = begun.pop(key)
        if key not in rounds or t0 > rounds[key][0]:
          rounds[key] = (t0, ev["time"] - t0)
  return [rounds[k][1] for k in sorted(rounds)]


def sync_waits(events: list[dict]) -> list[float]:
  """One learner's waits for the syncer's replies: sync_begin to the next sync_end, in order."""
  out, begun = [], None
  for ev in events:
    if ev["event"] == "sync_begin":
      begun = ev["time"]
    elif ev["event"] == "sync_end" and begun is not None:
      out.append(ev["time"] - begun)
      begun = None
  return out


# -- the runs --------------------------------------------------------------------------------------

def _row(summary: dict, fault_free: dict | None, rate: float, scenario: str = "poisson kills",
         variant: str = "tiny") -> dict:
  rejoin = summary["rejoin_s"]
  e = summary["config"]["elastic"]
  slow = {
    int(f.split(":")[1].split("=")[1]) for f in e["faults"].split(",") if f.startswith("slow")
  }
  fast_waits = [w for i, evs in enumerate(summary["events"]) if i not in slow
                for w in sync_waits(evs)]
  end = max(ev["time"] for evs in summary["events"] for ev in evs)
  spent = {k: 0.0 for k in KINDS}
  phases = []
  for i, evs in enumerate(summary["events"]):
    deaths = [d["time"] for d in summary["deaths"] if d["learner"] == i]
    for kind, a, b in intervals(evs, deaths, end):
      spent[kind] += b - a
    phases += [p for p in (rejoin_phases(evs, d) for d in deaths) if p]
  return {
      "scenario": scenario, "variant": variant,
      "late": e["late"], "adaptive_grace": e["adaptive_grace"], "grace_s": e["grace_s"],
      "learners": summary["learners"], "faults_per_hour": rate,
      "goodput": summary["goodput"], "participation": summary["participation"],
      "participation_per_learner": summary["participation_per_learner"],
      "median_rejoin_s": statistics.median(rejoin) if rejoin else None,
      "rejoin_s": rejoin,
      "eval_loss": summary["final_eval_loss"],
      "eval_loss_fault_free": (fault_free or summary)["final_eval_loss"],
      "faults": len(summary["faults"]), "deaths": len(summary["deaths"]),
      "steps": summary["steps"], "learner_steps": summary["learner_steps"],
      "rounds": len(summary["participation_per_round"]),
      "wall_time_s": summary["wall_time_s"],
      "fast_learner_median_wait_s": statistics.median(fast_waits) if fast_waits else None,
      "grace_waited_s_mean": statistics.mean(r["grace_waited_s"] for r in summary["round_log"])
                             if summary["round_log"] else None,
      "tokens_dropped": summary["tokens_dropped"],
      "tokens_computed": summary["tokens_computed"], "tokens_merged": summary["tokens_merged"],
      # the steps a dead learner's shard skips are not computed: goodput does not see them
      "tokens_computed_vs_fault_free": summary["tokens_computed"]
                                       / (fault_free or summary)["tokens_computed"],
      "learner_seconds": spent,
      "rejoin_phases_median_s": {k: statistics.median(p[k] for p in phases if k in p)
                                 for k in ("restart", "construct", "called", "heal",
                                           "from_last_event")}
                                if phases else None,
      "rejoin_phases_s": phases,
  }


# -- the in-program all-reduce ---------------------------------------------------------------------

def _allreduce_worker(spec: str) -> None:
  """One process of the all-reduce timing: prints the median seconds (process 0)."""
  process_id, num_processes, port, shapes_path = spec.split(",")
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  from lowcomm_jax import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize("on", f"127.0.0.1:{port}", int(num_processes), int(process_id))
  n = jax.process_count()
  mesh = jax.make_mesh((n,), ("replica",))
  shapes = json.loads(pathlib.Path(shapes_path).read_text())
  local = jax.local_devices()[0]
  stacked = NamedSharding(mesh, PartitionSpec("replica"))
  replicated = NamedSharding(mesh, PartitionSpec())
  # Δ of every replica, stacked on the replica axis as the SPMD DiLoCo run holds it
  deltas = [jax.make_array_from_single_device_arrays(
      (n, *s), stacked, [jax.device_put(np.full((1, *s), jax.process_index() + 1.0, np.float32),
                                        local)]) for s in shapes]
  mean = jax.jit(lambda xs: [jnp.mean(x, axis=0) for x in xs], out_shardings=replicated)
  times = []
  for i in range(int(os.environ.get("ALLREDUCE_REPEATS", "30")) + 3):
    began = time.perf_counter()
    jax.block_until_ready(mean(deltas))
    if i >= 3:  # compiled and warm
      times.append(time.perf_counter() - began)
  if jax.process_index() == 0:
    print(json.dumps({"allreduce_s": statistics.median(times), "times": times}), flush=True)
  jax.distributed.shutdown()


def allreduce_seconds(shapes: list, num_processes: int, repeats: int) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "shapes.json"
    path.write_text(json.dumps(shapes))
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    env = {**os.environ, "ALLREDUCE_REPEATS": str(repeats), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__,
                               f"--allreduce_worker={i},{num_processes},{port},{path}"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
             for i in range(num_processes)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
  if any(p.returncode for p in procs):
    raise RuntimeError(f"an all-reduce process failed: {[p.returncode for p in procs]}")
  return json.loads(outs[0].strip().splitlines()[-1])


def _param_shapes(config) -> list:
  import jax  # pylint: disable=g-import-not-at-top

  from lowcomm_jax.elastic import options  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train.trainer import Trainer  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    abstract = Trainer(options.learner_config(config), tmp).abstract_params()
  return [list(x.shape) for x in jax.tree.leaves(abstract)]


# -- the picture -----------------------------------------------------------------------------------

def plot(path: str, runs: list[tuple[str, dict]]) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  colors = {"starting": "tab:gray", "training": "tab:green", "syncing": "tab:blue",
            "dead": "tab:red", "healing": "tab:orange"}
  fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.6 + 0.7 * sum(
      s["learners"] for _, s in runs)), squeeze=False)
  for ax, (title, s) in zip(axes[:, 0], runs):
    t0 = min(ev["time"] for evs in s["events"] for ev in evs)
    end = max(ev["time"] for evs in s["events"] for ev in evs)
    for i, evs in enumerate(s["events"]):
      deaths = [d["time"] for d in s["deaths"] if d["learner"] == i]
      for kind, a, b in intervals(evs, deaths, end):
        ax.barh(i, b - a, left=a - t0, height=0.7, color=colors[kind], linewidth=0)
    ax.set_yticks(range(s["learners"]), [f"learner {i}" for i in range(s["learners"])])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first learner started")
    ax.set_title(title)
  handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colors.items()]
  fig.legend(handles=handles, loc="upper right", ncol=5)
  fig.tight_layout(rect=(0, 0, 1, 0.95))
  fig.savefig(path, dpi=110)


def main(argv):
  import elastic_runs  # pylint: disable=g-import-not-at-top (benchmarks/, beside this file)
  _config, _run = elastic_runs.config, elastic_runs.run
  del argv
  if _WORKER.value:
    _allreduce_worker(_WORKER.value)
    return
  base = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="elastic_bench_"))
  # both runs (and every restart) compile through one cache: a restarted learner compiles nothing
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(base / "jax_cache"))
  n = _LEARNERS.value
  free = _config(_STEPS.value, n, 0.0, _TIMEOUT.value)
  faulty = _config(_STEPS.value, n, _RATE.value, _TIMEOUT.value)
  s_free = _run(free, base / "fault_free")
  s_more = [_run(free, base / f"fault_free_{k}") for k in range(2, _FREE_RUNS.value + 1)]
  s_faulty = _run(faulty, base / "faulty")
  rows = (
    [_row(s_free, None, 0.0, "no faults")]
    + [_row(s, s_free, 0.0, "no faults") for s in s_more]
    + [_row(s_faulty, s_free, _RATE.value)]
  )
  if _STRAGGLER_STEPS.value:
    fault = f"slow:learner={n - 1}:step=1:factor={_STRAGGLER_FACTOR.value:g}"
    straggler_free = (s_free if _STRAGGLER_STEPS.value == _STEPS.value else
                      _run(_config(_STRAGGLER_STEPS.value, n, 0.0, _TIMEOUT.value),
                           base / "straggler_fault_free"))
    for adaptive in (False, True):
      for late in ("drop", "weight"):
        config = _config(_STRAGGLER_STEPS.value, n, 0.0, _TIMEOUT.value, **{
            "elastic.faults": fault, "elastic.adaptive_grace": adaptive, "elastic.late": late})
        name = f"straggler_{'adaptive' if adaptive else 'fixed'}_{late}"
        rows.append(_row(_run(config, base / name), straggler_free, 0.0,
                         f"straggler x{_STRAGGLER_FACTOR.value:g}"))
  if _SMALL_STEPS.value:
    small = lambda rate: _config(_SMALL_STEPS.value, n, rate, _TIMEOUT.value, "small",
                                 **{"outer.sync_every": min(30, _SMALL_STEPS.value)})
    s_small = _run(small(0.0), base / "small_fault_free")
    rows += [_row(s_small, None, 0.0, "no faults", "small"),
             _row(_run(small(_RATE.value), base / "small_faulty"), s_small, _RATE.value,
                  "poisson kills", "small")]
  waits = last_arrival_waits(s_free["events"])
  reduce = allreduce_seconds(_param_shapes(free), n, _REPEATS.value)
  round_s = statistics.median(waits)
  result = {
      "date": datetime.date.today().isoformat(),
      "command": "python benchmarks/elastic.py " + " ".join(sys.argv[1:]),
      "variant": "tiny", "steps": _STEPS.value, "sync_every": free.outer.sync_every,
      "min_quorum": free.elastic.min_quorum, "grace_s": free.elastic.grace_s,
      "cpus": os.cpu_count(),
      "rows": rows,
      "round_time": {
          "syncer_round_s": round_s, "syncer_round_s_per_round": waits,
          "allreduce_s": reduce["allreduce_s"], "allreduce_s_all": reduce["times"],
          "ratio": round_s / reduce["allreduce_s"],
          "what": "syncer_round_s: fault-free run, per round the last-arriving learner's wait "
                  "from sync_begin to sync_end (Ray call to the syncer: decode, token-weighted "
                  "merge, outer Nesterov, reply), median over rounds; allreduce_s: jitted mean "
                  f"over {n} jax.distributed CPU processes (gloo, 127.0.0.1) of the same float32 "
                  "parameters, median of warm calls"},
      "deaths": s_faulty["deaths"], "faults": s_faulty["faults"],
  }
  pathlib.Path(_OUT.value).write_text(json.dumps(result, indent=1) + "\n")
  plot(_PLOT.value, [(f"{n} learners, {_RATE.value:g} faults per hour (Poisson kills)", s_faulty),
                     (f"{n} learners, no faults", s_free)])
  for row in result["rows"]:
    print(json.dumps(row))
  print(json.dumps({k: v for k, v in result["round_time"].items() if not isinstance(v, list)}))


if __name__ == "__main__":
  app.run(main)
