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
bench_<scale>.png (eval loss against simulated time, one panel per link).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import importlib.util
import json
import math
import pathlib
import re
import sys
import time

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app, flags, logging

from lowcomm_jax import config as config_lib, models
from lowcomm_jax.data import corpora
from lowcomm_jax.sim import clock
from lowcomm_jax.train import Trainer, hooks

_HERE = pathlib.Path(__file__).parent
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

@dataclasses.dataclass(frozen=True)
class Claim:
  """A paper's claim about an entry's final eval loss against a baseline's, at equal tokens.

  Attributes:
    what: the claim in words.
    entry, baseline: entry names.
    paper: what the paper reports.
    max_diff_percent: the entry's loss may exceed the baseline's by at most this (%).
    two_sided: also at most this much below (a claim of "about equal").
    fewer_bytes: (entry whose bytes per worker are divided by the entry's, minimum ratio), or None.
  """

  what: str
  entry: str
  baseline: str
  paper: str
  max_diff_percent: float
  two_sided: bool = False
  fewer_bytes: tuple[str, float] | None = None


# The papers' claims (PAPERS.md), each for the tuned entry and, where it differs, the one with the
# paper's settings.
CLAIMS = (
    Claim("DiLoCo M=1 vs data-parallel", "diloco_m1", "dp",
          "≤ 0 (−0.1%, 35M, H = 30; arXiv 2503.09799 Table 4)", 0.0),
    Claim("DiLoCo M=2 vs data-parallel", "diloco_m2", "dp",
          "≤ +3% (+0.7%, 35M; arXiv 2503.09799 Table 4)", 3.0),
    Claim("DiLoCo M=2, the papers' momentum 0.9, vs data-parallel", "diloco_m2_paper", "dp",
          "≤ +3% (+0.7%, 35M; arXiv 2503.09799 Table 4)", 3.0),
    Claim("Streaming DiLoCo fp4 vs DiLoCo M=2", "streaming_fp4", "diloco_m2",
          "≈ 0 (within 1%) at ≥ 400× fewer bits than dp (3.53 vs 3.54; arXiv 2501.18512 "
          "Table 5)", 1.0, two_sided=True, fewer_bytes=("dp", 400.0)),
    Claim("SparseLoCo vs DiLoCo M=2", "sparseloco", "diloco_m2",
          "≤ +2% at ≥ 100× fewer bytes (arXiv 2508.15706)", 2.0,
          fewer_bytes=("diloco_m2", 100.0)),
    Claim("SparseLoCo, the paper's η = 1, vs DiLoCo M=2", "sparseloco_paper", "diloco_m2",
          "≤ +2% at ≥ 100× fewer bytes (arXiv 2508.15706)", 2.0,
          fewer_bytes=("diloco_m2", 100.0)),
    Claim("NoLoCo vs DiLoCo M=4", "noloco", "diloco_m4",
          "≤ 0 (up to 4% faster convergence; arXiv 2506.10911)", 0.0),
    Claim("DiLoCo M=2, eager, one outer step of overlap, vs DiLoCo M=2", "diloco_m2_eager",
          "diloco_m2", "≤ +1% (2.69 vs 2.67, +0.7%, 500M, H = 30; arXiv 2502.12996 Table 2)", 1.0),
)


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


def mean_se(values: list[float]) -> tuple[float, float | None]:
  """Mean and standard error of the mean (None for one value)."""
  n = len(values)
  mean = sum(values) / n
  if n < 2:
    return mean, None
  var = sum((v - mean) ** 2 for v in values) / (n - 1)
  return mean, math.sqrt(var / n)


def compare(a: list[float], b: list[float]) -> str:
  """"beats" when a's mean is lower than b's by more than 2 standard errors of the difference,
  "loses" when higher by as much, else "tie" (always with fewer than 2 values on a side)."""
  (ma, sa), (mb, sb) = mean_se(a), mean_se(b)
  if sa is None or sb is None:
    return "tie"
  margin = 2 * math.sqrt(sa**2 + sb**2)
  if ma < mb - margin:
    return "beats"
  if ma > mb + margin:
    return "loses"
  return "tie"


def summarize(task: Task, runs: list[dict]) -> dict:
  """Per entry: seeds, mean ± se of the final loss, bytes, and per link the time to target and
  whether it beats, ties or loses to the fastest entry on that link."""
  by_entry = {}
  for r in runs:
    by_entry.setdefault(r["entry"], []).append(r)
  table = {}
  for name, rs in sorted(by_entry.items()):
    loss, loss_se = mean_se([r["final_eval_loss"] for r in rs])
    row = {"seeds": len(rs), "final_eval_loss": loss, "final_eval_loss_se": loss_se,
           "bytes_per_worker": mean_se([r["bytes_per_worker"] for r in rs])[0],
           "reached": sum(r["links"] is not None for r in rs), "links": {}}
    for link in LINKS:
      times = [r["links"][link]["seconds"] for r in rs if r["links"]]
      util = [r["links"][link]["utilization"] for r in rs if r["links"]]
      row["links"][link] = ({"times": times, "mean": mean_se(times)[0], "se": mean_se(times)[1],
                             "utilization": mean_se(util)[0]}
                            if len(times) == len(rs) else None)  # every seed must reach it
    table[name] = row
  for link in LINKS:
    timed = {n: row["links"][link] for n, row in table.items() if row["links"][link]}
    if not timed:
      continue
    best = min(timed, key=lambda n: timed[n]["mean"])
    for n, cell in timed.items():
      cell["vs_fastest"] = ("fastest" if n == best
                            else compare(cell["times"], timed[best]["times"]))
      cell["vs"] = {other: compare(cell["times"], timed[other]["times"])
                    for other in timed if other != n}
  return table


def claims(table: dict) -> list[dict]:
  """The papers' claims, each with our figure (final eval loss at the budget, mean over seeds)."""
  out = []
  for c in CLAIMS:
    row = {"claim": c.what, "entry": c.entry, "baseline": c.baseline, "paper": c.paper}
    needed = [c.entry, c.baseline] + ([c.fewer_bytes[0]] if c.fewer_bytes else [])
    if all(n in table for n in needed):
      e, b = table[c.entry], table[c.baseline]
      diff = 100 * (e["final_eval_loss"] / b["final_eval_loss"] - 1)
      holds = diff <= c.max_diff_percent and (not c.two_sided or diff >= -c.max_diff_percent)
      row["loss_diff_percent"] = diff
      if c.fewer_bytes:
        other, minimum = c.fewer_bytes
        ratio = table[other]["bytes_per_worker"] / e["bytes_per_worker"]
        row["fewer_bytes_than"], row["bytes_ratio"] = other, ratio
        holds = holds and ratio >= minimum
      row["holds"] = holds
    out.append(row)
  return out


def _fmt_seconds(s: float, scale: float | None = None) -> str:
  """3 significant digits; below 1e-9 of `scale` (a standard error of a mean that large) is 0."""
  if scale is not None and abs(s) < 1e-9 * scale:
    return "0"
  return f"{s:.3g}" if s < 1000 else f"{s:,.0f}"


def markdown(scale: str, task: Task, table: dict, claim_rows: list[dict], command: str) -> str:
  lines = [f"`{command}` (bench_{scale}.json, bench_{scale}.png): model `{task.model}`, corpus "
           f"`{task.corpus}`, {task.batch} × {task.seq_len} tokens per step, {task.steps} steps, "
           f"target eval loss {task.target_loss}, H = {task.sync_every}; a step declared "
           f"{task.step_seconds:.3g} s ({task.accelerator}, MFU {task.mfu}). Cells: simulated "
           "seconds to the target, mean ± standard error over the seeds; **bold**: the fastest "
           "on the link and every entry that ties with it (difference within 2 standard errors); "
           f"– : a seed did not reach the target. The target is read at evaluations (every "
           f"{task.eval_every} steps): seeds crossing at the same one give equal times "
           "(standard error 0).", "",
           "| entry | seeds | final eval loss | MB per worker | "
           + " | ".join(LINKS) + " |", "|---|---|---|---|" + "---|" * len(LINKS)]
  for name, row in table.items():
    loss = f"{row['final_eval_loss']:.4f}" + (f" ± {row['final_eval_loss_se']:.4f}"
                                              if row["final_eval_loss_se"] is not None else "")
    cells = []
    for link in LINKS:
      cell = row["links"][link]
      if cell is None:
        cells.append("–")
        continue
      text = _fmt_seconds(cell["mean"]) + (f" ± {_fmt_seconds(cell['se'], cell['mean'])}"
                                           if cell["se"] is not None else "")
      cells.append(f"**{text}**" if cell.get("vs_fastest") in ("fastest", "tie") else text)
    lines.append(f"| {name} | {row['seeds']} | {loss} | {row['bytes_per_worker'] / 1e6:.3f} | "
                 + " | ".join(cells) + " |")
  lines += ["", "| the papers' claim | paper | ours (final eval loss, bytes ratio) | holds here |",
            "|---|---|---|---|"]
  for c in claim_rows:
    if "loss_diff_percent" not in c:
      lines.append(f"| {c['claim']} | {c['paper']} | not run | – |")
      continue
    ratio = (f", {c['bytes_ratio']:.0f}× fewer bytes than {c['fewer_bytes_than']}"
             if "bytes_ratio" in c else "")
    lines.append(f"| {c['claim']} | {c['paper']} | {c['loss_diff_percent']:+.2f}%{ratio} | "
                 f"{'yes' if c['holds'] else '**no**'} |")
  lines += ["", "Tried where a claim fails: the tuned entries beside the papers' settings (DiLoCo "
            "outer momentum 0.5 against 0.9; SparseLoCo η = 2 against 1); no other sweep at this "
            "scale."]
  return "\n".join(lines) + "\n"


def write_readme_section(readme: pathlib.Path, scale: str, text: str) -> bool:
  """Replaces what lies between the scale's markers in `readme`; False when it has none."""
  if not readme.exists():
    return False
  start, end = f"<!-- bench:{scale} -->", f"<!-- /bench:{scale} -->"
  old = readme.read_text()
  pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
  if not pattern.search(old):
    return False
  new = pattern.sub(lambda _: f"{start}\n{text}{end}", old)
  tmp = readme.with_suffix(".tmp")
  tmp.write_text(new)
  tmp.replace(readme)  # whole: a reader never sees half a README
  return True


def plot(path: pathlib.Path, runs: list[dict], task: Task) -> None:
  fig, axes = plt.subplots(1, len(LINKS), figsize=(5 * len(LINKS), 4), sharey=True)
  colors = {}
  for ax, link in zip(axes, LINKS):
    for r in runs:
      if r["seed"] != 0:
        continue
      color = colors.setdefault(r["entry"], f"C{len(colors) % 10}")
      ax.plot([cell["seconds"] for cell in r["curve_links"][link]],
              [loss for _, loss in r["eval_curve"]], ".-", lw=1, color=color, label=r["entry"])
    ax.axhline(task.target_loss, color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_title(link, fontsize=10)
    ax.set_xlabel("simulated seconds")
  axes[0].set_ylabel("eval loss (nats per token), seed 0")
  axes[-1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def _key(name: str, seed: int) -> str:
  return f"{name} seed={seed}"


def write_outputs(scale: str, task: Task, runs: dict, results_dir: pathlib.Path,
                  command: str) -> str:
  ordered = [{**r, **score(r, task.target_loss)}  # the task's target now
             for r in sorted(runs.values(), key=lambda r: (r["entry"], r["seed"]))]
  table = summarize(task, ordered)
  claim_rows = claims(table)
  results_dir.mkdir(parents=True, exist_ok=True)
  out = results_dir / f"bench_{scale}.json"
  tmp = out.with_suffix(".tmp")
  tmp.write_text(json.dumps({"scale": scale, "task": dataclasses.asdict(task),
                             "step_seconds": task.step_seconds, "links": LINKS,
                             "command": command, "runs": ordered, "table": table,
                             "claims": claim_rows}, indent=1))
  tmp.replace(out)
  text = markdown(scale, task, table, claim_rows, command)
  (results_dir / f"bench_{scale}.md").write_text(text)
  write_readme_section(results_dir / "README.md", scale, text)
  plot(results_dir / f"bench_{scale}.png", ordered, task)
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
