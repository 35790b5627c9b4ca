"""Every method at fixed compute and bandwidth: simulated time to a target eval loss on four links.

  python benchmarks/bench.py --scale=quick                    # every entry, the task's seeds
  python benchmarks/bench.py --scale=quick --entries=dp,diloco_m2 --seeds=1
  python benchmarks/bench.py --scale=cpu --workdir=/work/bench_runs   # resumable; about 2 hours

A **task** per scale fixes the model preset, the corpus, the tokens per step (global: M replicas
share them), the token budget (steps) and a target eval loss. An **entry** is a file
`benchmarks/entries/<name>.py` whose `changes(task)` returns the config changes of one method; a
new method is a new file. Every entry runs `seeds` times (seed 0, 1, ...), each run in its own
workdir under --workdir/<scale>/; a finished run is written to
benchmarks/results/bench_<scale>.json at once, so rerunning the command runs only what is missing.
Each run records the identity of the text it trained on (`lowcomm_jax.data.corpora.corpus_identity`:
`stdlib` is the running Python's standard library, so another Python reads other text); the
command refuses to add runs to a results file holding runs on another corpus, or on one they did not
record, since their losses do not compare.

The score of a run on a link is the simulated wall time to the target: the run's own virtual clock
(`lowcomm_jax.sim.clock`, its ledger's collectives with their overlap) over its first S steps,
where S is the first evaluated step whose eval loss is at or below the target, each step taking
the task's declared compute seconds, FLOPs per step / (MFU × peak FLOP/s of the declared
accelerators). It does not depend on the machine that ran it. So for a blocking algorithm it is
S × step seconds + the seconds of every collective issued in those S steps. Between two entries on
one link, one **beats** the other when its mean time is lower by more than 2 standard errors of
the difference (√(se₁² + se₂²), the standard error of each mean over its seeds); otherwise they
**tie** (and always with one seed). A run that never reaches the target has no time.

An entry's hyperparameters come from a recorded sweep at a scale (benchmarks/sweep.py: the grid and
every point's result in benchmarks/entries/<entry>.sweep_<scale>.json beside the entry).

Outputs: bench_<scale>.json (every run: curve, steps to target, per-link time, bytes per worker),
bench_<scale>.md (the table and the papers' claims), the same Markdown between the markers
`<!-- bench:<scale> -->` and `<!-- /bench:<scale> -->` in the results README when it has them, and
bench_<scale>.png (eval loss against simulated time, one panel per link); `bench_report` writes
them and holds the significance rule and the claims.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import importlib.util
import json
import pathlib
import sys
import time

import jax
from absl import app, flags, logging

from lowcomm_jax import config as config_lib, models
from lowcomm_jax.data import corpora
from lowcomm_jax.sim import clock
from lowcomm_jax.train import Trainer, hooks

_HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(_HERE))
import bench_report  # pylint: disable=g-import-not-at-top,wrong-import-position  # noqa: E402

ENTRIES_DIR = _HERE / "entries"

# name -> (bandwidth bit/s, one-way latency s): the links every run is scored on.
LINKS = {"datacenter": "400Gbit,0s", "10 Gbit/s": "10Gbit,0s", "1 Gbit/s + 50 ms": "1Gbit,50ms",
         "100 Mbit/s + 100 ms": "100Mbit,100ms"}


@dataclasses.dataclass(frozen=True)
class Task:
  """What every entry of a scale trains and is scored on.

  Attributes:
    model: model preset (lowcomm_jax.models.PRESETS).
    corpus: data.corpus (held-out split: data.eval_permille's documents).
    seq_len: tokens per sequence.
    batch: sequences per step over all replicas (an entry with M replicas gives each batch / M).
    steps: the token budget in steps (budget = steps × batch × seq_len tokens).
    target_loss: eval loss (nats per token) whose first crossing is timed.
    sync_every: H of the entries that sync every H steps.
    eval_every: evaluation period in steps (the resolution of the steps to target).
    eval_batches: eval batches of `batch` sequences.
    seeds: default seeds per entry.
    accelerator: the declared hardware, in words.
    peak_flops: its peak FLOP/s, all accelerators together.
    mfu: the declared model FLOPs utilization of a training step.
    warmup_steps: the inner learning rate's linear warm-up.
  """

  model: str
  corpus: str
  seq_len: int
  batch: int
  steps: int
  target_loss: float
  sync_every: int
  eval_every: int
  eval_batches: int
  seeds: int
  accelerator: str
  peak_flops: float
  mfu: float
  warmup_steps: int

  @property
  def tokens_per_step(self) -> int:
    return self.batch * self.seq_len

  @property
  def step_seconds(self) -> float:
    """Declared compute seconds of one step: its training FLOPs / (MFU × peak)."""
    flops = models.flops_per_token(models.get_model_config(self.model), self.seq_len)
    return flops * self.tokens_per_step / (self.mfu * self.peak_flops)


TASKS = {
    # Two entries end to end in seconds (the test suite's); its target is what dp reaches at 2/3 of
    # the budget (step 40 of 60, seed 0: 3.205; 3.111 at step 50).
    "quick": Task(model="tiny", corpus="stdlib", seq_len=64, batch=8, steps=60, target_loss=3.25,
                  sync_every=10, eval_every=10, eval_batches=2, seeds=3,
                  accelerator="one CPU core at 50 GFLOP/s", peak_flops=50e9, mfu=0.5,
                  warmup_steps=6),
    # Every entry, one seed, in about 2 hours on 2 cores (or minutes on one GPU). Target: what dp
    # reaches at 70% of the budget (step 840, seed 0: 1.519; seed 1: 1.504; bench_cpu.json).
    "cpu": Task(model="small", corpus="stdlib", seq_len=128, batch=16, steps=1200,
                target_loss=1.52, sync_every=30, eval_every=60, eval_batches=8, seeds=1,
                accelerator="one CPU core at 50 GFLOP/s", peak_flops=50e9, mfu=0.5,
                warmup_steps=60),
    # The paper-shaped 35M model; 8 H100s at their bf16 datasheet peak, the MFU sdl_35m reached on
    # one H200 (benchmarks/results/README.md). `stdlib` holds about 12M byte tokens, 185 steps of
    # this batch: 3,000 steps read it 16 times and dp's eval loss turns up after step 1,350
    # (bench_gpu.json), so the target stays provisional until this task reads a corpus of at
    # least its 197M tokens.
    "gpu": Task(model="sdl_35m", corpus="stdlib", seq_len=1024, batch=64, steps=3000,
                target_loss=1.2, sync_every=30, eval_every=150, eval_batches=8, seeds=1,
                accelerator="8 NVIDIA H100 SXM (989 TFLOP/s bf16 each)", peak_flops=8 * 989e12,
                mfu=0.3, warmup_steps=150),
    # The `gpu` task's first tenth, for one accelerator at hand (every entry in about a minute on
    # one H200). Target: what dp reaches at 70% of the budget (step 210 of 300, seed 0: 1.468).
    "gpu_quick": Task(model="sdl_35m", corpus="stdlib", seq_len=1024, batch=64, steps=300,
                      target_loss=1.47, sync_every=30, eval_every=30, eval_batches=8, seeds=1,
                      accelerator="8 NVIDIA H100 SXM (989 TFLOP/s bf16 each)",
                      peak_flops=8 * 989e12, mfu=0.3, warmup_steps=15),
}

def entry_names() -> list[str]:
  return sorted(p.stem for p in ENTRIES_DIR.glob("*.py") if not p.stem.startswith("_"))


def load_entry(name: str):
  spec = importlib.util.spec_from_file_location(f"bench_entry_{name}", ENTRIES_DIR / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def workers(changes: dict) -> int:
  """M: the sites a run's collectives join (dp: its data-parallel devices)."""
  if changes["algorithm"] == "dp":
    return int(changes.get("mesh.data", 1))
  return int(changes.get("num_replicas", 1))


def make_config(task: Task, entry_changes: dict, seed: int, num_devices: int):
  """The task's run of one entry: its batch split over the entry's replicas. dp on fewer devices
  than its sites trains on one device (the same global batch, the same updates); its all-reduce
  between the sites is priced all the same (`priced_sites`)."""
  m = workers(entry_changes)
  if task.batch % m:
    raise ValueError(f"batch {task.batch} is not divisible by the entry's {m} workers")
  c = config_lib.default_config()
  c.model.size, c.data.corpus = task.model, task.corpus
  c.data.seq_len, c.num_steps, c.seed = task.seq_len, task.steps, seed
  c.data.batch_size = task.batch if entry_changes["algorithm"] == "dp" else task.batch // m
  c.optimizer.warmup_steps = task.warmup_steps
  c.eval.every, c.eval.batch_size = task.eval_every, task.batch
  c.eval.num_batches = task.eval_batches
  c.checkpoint.every = task.eval_every
  c.log_every, c.progress_bar = task.eval_every, False
  changes = dict(entry_changes)
  if changes["algorithm"] == "dp" and m > num_devices:
    changes["mesh.data"] = 1
  return config_lib.override(c, {"mesh.data": 1, **changes})


def priced_sites(trainer, entry_changes: dict) -> int | None:
  """The sites whose all-reduce the clock prices for a dp run that trained on fewer devices
  (dp's collectives follow from its sites and the parameter count alone); None otherwise."""
  sites = workers(entry_changes)
  if entry_changes["algorithm"] != "dp" or trainer.mesh.shape["data"] == sites:
    return None
  return sites


def steps_to_target(curve: list, target: float) -> int | None:
  """The first evaluated step whose eval loss is at or below `target`; None if none is."""
  return next((step for step, loss in curve if loss <= target), None)


def link_times(events: list, step_seconds: float, steps: int) -> dict:
  """Per link: the clock's wall time of the first `steps` steps and its compute utilization."""
  out = {}
  for link, spec in LINKS.items():
    timeline = clock.simulate_run(step_seconds, events, spec, num_steps=steps)
    out[link] = {"seconds": timeline.wall_seconds,
                 "comm_stall_seconds": timeline.wall_seconds - timeline.compute_seconds,
                 "utilization": timeline.compute_utilization}
  return out


def run_one(task: Task, name: str, seed: int, workdir: pathlib.Path, devices=None,
            changes: dict | None = None) -> dict:
  """Trains one (entry, seed) (resuming its workdir) on `devices` (default: every device) and
  scores it on every link; `changes` in place of the entry's own (a sweep's point)."""
  changes = load_entry(name).changes(task) if changes is None else changes
  devices = devices or jax.devices()
  trainer = Trainer(make_config(task, changes, seed, len(devices)), workdir, devices=devices)
  final = hooks.FinalState()
  start = time.perf_counter()
  summary = trainer.run(hooks=[final])
  seconds = time.perf_counter() - start
  # A workdir already complete trains nothing: its ledger is traced from the abstract state, and
  # its training seconds are the ones its summary recorded.
  if summary.get("complete_before_start", False):
    return record(task, name, seed, trainer, workdir, trainer.abstract_state(),
                  {"devices": trainer.mesh.size, "device_kind": None,
                   "train_seconds": summary["wall_time_s"], "complete_before_start": True},
                  changes)
  return record(task, name, seed, trainer, workdir, final.state,
                {"devices": trainer.mesh.size, "device_kind": devices[0].device_kind,
                 "train_seconds": seconds, "complete_before_start": False}, changes)


def record(task: Task, name: str, seed: int, trainer, workdir: pathlib.Path, state,
           ran_on: dict, changes: dict | None = None) -> dict:
  """One finished run's record: its curve and summary read from `workdir`, its ledger on the
  clock at every evaluation from `trainer` (a Trainer of the run's config; `state` concrete or
  abstract), and `ran_on`, the machine that trained it (the score does not depend on it; a
  resumed run's seconds count only its last part). `changes`: the run's (default: the entry's)."""
  changes = load_entry(name).changes(task) if changes is None else changes
  summary = json.loads((workdir / "summary.json").read_text())
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  curve = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
  if not curve or curve[-1][0] != task.steps:
    curve.append((task.steps, summary["final_eval_loss"]))
  sites = priced_sites(trainer, changes)
  if sites is None:
    events_of = lambda step: trainer.comm_events(step, state)
    sent = summary["bytes_sent_per_worker"]
  else:
    events_of = lambda step: trainer.algorithm.comm_events(step, None, sites, trainer.num_params)
    sent = trainer.algorithm.comm_summary(summary["steps"], 0, 0, sites, trainer.num_params)
  # The clock at each evaluation: when its parameters exist on each link (the plot's x axis, and
  # the time to target at the first one at or below it).
  times_at = [link_times(events_of(step), task.step_seconds, step) for step, _ in curve]
  return {"entry": name, "seed": seed, "algorithm": changes["algorithm"],
          "workers": workers(changes), "changes": changes, "workdir": str(workdir),
          "final_eval_loss": summary["final_eval_loss"], "steps": summary["steps"],
          "tokens": summary["tokens"],
          "bytes_per_worker": sent["total"], "peak_bytes_per_sync": sent["peak_per_sync"],
          "eval_curve": curve,
          "curve_links": {link: [t[link] for t in times_at] for link in LINKS},
          "ran_on": {**ran_on, "priced_sites": sites},
          # the text it trained on (`stdlib` is the running Python's standard library)
          "corpus_identity": trainer.corpus_identity,
          "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def score(run: dict, target: float) -> dict:
  """steps_to_target and, per link, the clock at that evaluation (None when never reached)."""
  reached = steps_to_target(run["eval_curve"], target)
  if reached is None:
    return {"steps_to_target": None, "links": None}
  i = [step for step, _ in run["eval_curve"]].index(reached)
  return {"steps_to_target": reached,
          "links": {link: cells[i] for link, cells in run["curve_links"].items()}}


def _key(name: str, seed: int) -> str:
  return f"{name} seed={seed}"


def write_outputs(scale: str, task: Task, runs: dict, results_dir: pathlib.Path,
                  command: str) -> str:
  ordered = [{**r, **score(r, task.target_loss)}  # the task's target now
             for r in sorted(runs.values(), key=lambda r: (r["entry"], r["seed"]))]
  table = bench_report.summarize(ordered, LINKS)
  claim_rows = bench_report.claims(table)
  results_dir.mkdir(parents=True, exist_ok=True)
  out = results_dir / f"bench_{scale}.json"
  tmp = out.with_suffix(".tmp")
  tmp.write_text(json.dumps({"scale": scale, "task": dataclasses.asdict(task),
                             "step_seconds": task.step_seconds, "links": LINKS,
                             "command": command, "runs": ordered, "table": table,
                             "claims": claim_rows}, indent=1))
  tmp.replace(out)
  text = bench_report.markdown(scale, task, table, claim_rows, command, LINKS)
  (results_dir / f"bench_{scale}.md").write_text(text)
  bench_report.write_readme_section(results_dir / "README.md", scale, text)
  bench_report.plot(results_dir / f"bench_{scale}.png", ordered, task.target_loss, LINKS)
  return text


class MixedCorpus(ValueError):
  """A results file's runs trained on other text than the task's corpus here (one line)."""


def check_same_corpus(task: Task, runs: dict, out: pathlib.Path) -> None:
  """Refuses (MixedCorpus) to add runs to `out` when a run in it trained on other text
  than the task's corpus reads here, or on text it did not record: their losses do not compare."""
  here = corpora.corpus_identity(task.corpus)
  other = sorted({r.get("corpus_identity") or "unrecorded" for r in runs.values()} - {here})
  if other:
    raise MixedCorpus(f"--results_dir: {out} holds runs on another corpus ({', '.join(other)}; "
                     f"{task.corpus!r} here is {here}): give another --results_dir")


def _refuse(message: str) -> None:
  print(message, file=sys.stderr)
  sys.exit(2)


def bench(scale: str, chosen: list[str], seeds: int, workdir: pathlib.Path,
          results_dir: pathlib.Path) -> int:
  """Runs the (entry, seed) pairs not yet in bench_<scale>.json, each recorded once finished, and
  rewrites the outputs; returns how many it ran."""
  task = TASKS[scale]
  out = results_dir / f"bench_{scale}.json"
  runs = {_key(r["entry"], r["seed"]): r
          for r in (json.loads(out.read_text())["runs"] if out.exists() else [])}
  check_same_corpus(task, runs, out)
  command = f"python benchmarks/bench.py --scale={scale}"
  ran = 0
  for name in chosen:
    for seed in range(seeds):
      if _key(name, seed) in runs:
        continue
      print(f"== {name} seed {seed} at {time.strftime('%H:%M:%S', time.gmtime())} UTC",
            flush=True)
      runs[_key(name, seed)] = run_one(task, name, seed, workdir / scale / f"{name}_seed{seed}")
      ran += 1
      write_outputs(scale, task, runs, results_dir, command)  # recorded at once: resumable
  print(write_outputs(scale, task, runs, results_dir, command))
  print(f"ran {ran} runs; {len(runs)} recorded in {out}")
  return ran


def define_flags() -> dict:
  """The command's flags (defined by the command only: the module's functions import alone)."""
  return {
    "scale": flags.DEFINE_string("scale", "quick", f"Task scale: {' | '.join(TASKS)}."),
    "entries": flags.DEFINE_string("entries", "", "Comma-separated entry names (files in "
                                   "benchmarks/entries/); empty: every entry."),
    "seeds": flags.DEFINE_integer("seeds", 0, "Seeds per entry (0: the task's)."),
    "workdir": flags.DEFINE_string("workdir", "runs/bench", "Where the runs live "
                                   "(<workdir>/<scale>/<entry>_seed<n>)."),
    "results_dir": flags.DEFINE_string("results_dir", str(_HERE / "results"),
                                       "Where bench_<scale>.{json,md,png} go; its README.md gets "
                                       "the table between the markers when it has them."),
  }


def main(argv, flag: dict):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint at INFO
  scale, seeds = flag["scale"].value, flag["seeds"].value
  if scale not in TASKS:
    _refuse(f"--scale: {scale!r} is not a scale; allowed: {', '.join(TASKS)}")
  known = entry_names()
  chosen = [e.strip() for e in flag["entries"].value.split(",") if e.strip()] or known
  unknown = [e for e in chosen if e not in known]
  if unknown:
    _refuse(f"--entries: no entry {', '.join(map(repr, unknown))}; allowed: {', '.join(known)}")
  if seeds < 0:
    _refuse(f"--seeds: must be >= 0 (0: the task's), got {seeds}")
  try:
    bench(scale, chosen, seeds or TASKS[scale].seeds, pathlib.Path(flag["workdir"].value),
          pathlib.Path(flag["results_dir"].value))
  except MixedCorpus as error:
    _refuse(str(error))


if __name__ == "__main__":
  _FLAGS = define_flags()
  app.run(lambda argv: main(argv, _FLAGS))
