"""Wall time of DiLoCo and Streaming DiLoCo (τ = 0, 1, 2; the overlapped fragments issued by the
outer-communication thread or inline) between two processes on a shaped link, next to the virtual
clock's prediction for the same link.

  nice -n 10 python benchmarks/slow_link.py [--link=20Mbit,0ms]   # as root; H = 6, steps 21..39
  # τ = 2 rows only:
  nice -n 10 python benchmarks/slow_link.py --taus=2 --out=/tmp/slow_link_tau2.json
  nice -n 10 python benchmarks/slow_link.py --sync_every=10 --warm_steps=12 --steps=32 \
    --out=benchmarks/results/slow_link_h10.json   # H = 10: the thread's gain is at most 1.4×
  # all-reduce-bound:
  nice -n 10 python benchmarks/slow_link.py --sync_every=10 --warm_steps=12 --steps=32 \
    --batch_size=2 --seq_len=64 --out=benchmarks/results/slow_link_comm_bound.json

Two network namespaces joined by a veth pair; `tc` gives each direction the link's rate and
one-way delay (netem; a link without delay uses tbf, for kernels without netem such as this
sandbox's). Process 0 (the coordinator) runs in one namespace and process 1 in the other, through
experiments/launch_local.py, so every byte between them (gloo's all-reduces, the runtime's
heartbeats) crosses the shaped link. Each algorithm runs on the unshaped veth (the fastest of
--unshaped_repeats runs) and on the shaped one; the time of steps warm_steps+1 .. steps (all
programs compiled by then, no eval, two metric gathers) comes from metrics.jsonl. The prediction:
lowcomm_jax.sim.clock on the run's own collectives, with the per-step compute time of the unshaped
run. Writes benchmarks/results/slow_link.json (`rows`: run, executor, tau, unshaped_s, shaped_s,
clock_s) and beside it slow_link_timeline.png (process 0's steps and the executor's all-reduces,
from benchmarks/slow_link_worker.py's timeline.json, for Streaming τ = 2 on the shaped link,
thread against inline). Needs root, `ip` and `tc` (iproute2); the namespaces and the
veth pair are removed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

_LINK = flags.DEFINE_string("link", "20Mbit,0ms", "Rate and one-way delay of the shaped link.")
# Logged steps are warm_steps, its multiples and the last (log_every = warm_steps). With several
# processes a metric gather (one step late) waits for the executor's collectives first, so a gather
# on a step with a fragment in flight would hide none of its all-reduce: the defaults log step 20
# (gathered at step 21) and the last, 39. At H = 6, P = 2, τ = 2 a fragment is sent with every step
# ≡ 1 (mod 3) and is in flight for two steps, so only steps ≡ 0 (mod 3) are free. At H = 10,
# --warm_steps=12 --steps=32 log steps 12 and 24 (gathered at 13 and 25; sends are steps ≡ 1 mod 5).
_STEPS = flags.DEFINE_integer("steps", 39, "Steps per run.")
_WARM = flags.DEFINE_integer("warm_steps", 20, "Steps before the timed window (compiles).")
_TAUS = flags.DEFINE_list("taus", None, "Only the Streaming rows with these τ (e.g. 2, while "
                          "iterating; write them with --out elsewhere). Default: every row.")
# The default step (16 × 128 tokens per replica, the `small` model) takes about 0.6 s on this
# 2-core machine, so one fragment's all-reduce at 20 Mbit/s (about 1.1 s on the clock, 1.2-1.3 s
# measured) spans about two inner steps: as much as τ = 2 can hide. With τ steps beside it, a
# period of H/P steps takes max(C, τ·s) + (H/P − τ)·s with the thread and C + (H/P)·s inline (C the
# all-reduce, s a step), so the thread's gain is largest, (H/P + τ)/(H/P), when C = τ·s: 1.67× at
# the default H = 6 (H/P = 3, the shortest period with room for τ = 2, which must be < H/P), 1.4×
# at H = 10 (H/P = 5). --batch_size=2 --seq_len=64 is the all-reduce-bound case (C ≈ 30·s).
_SYNC_EVERY = flags.DEFINE_integer("sync_every", 6,
                                   "H: inner steps per outer step (P = 2 fragments).")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Sequences per replica per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.")
# Other jobs on this shared machine only ever slow a run down: the clock takes its step time from
# the fastest of these unshaped runs.
_UNSHAPED_REPEATS = flags.DEFINE_integer("unshaped_repeats", 2,
                                         "Unshaped runs per row (the fastest "
                                         "gives the clock's step time and unshaped_s).")
_REPLOT = flags.DEFINE_bool("replot", False, "Only redraw the timeline PNG from --out's timelines.")
_OUT = flags.DEFINE_string("out", str(ROOT / "benchmarks" / "results" / "slow_link.json"),
                           "Where to write the results.")

NAMESPACES = ("lcj_slow0", "lcj_slow1")
ADDRESSES = ("10.231.7.1", "10.231.7.2")  # inside the namespaces only
WORKER = ROOT / "benchmarks" / "slow_link_worker.py"
_STREAMING = {"algorithm": "streaming_diloco", "outer.num_fragments": 2,
              "outer.non_block_fragment": "fold", "outer.merge_alpha": 0.5}
# (run, executor, τ): DiLoCo and τ = 0 have nothing to overlap (their all-reduce blocks the step
# that merges it), so they run inline only.
def runs(h: int) -> list[tuple[str, str, int, dict]]:
  return [(f"diloco H={h}", "inline", 0, {"algorithm": "diloco"})] + [
      (f"streaming P=2 τ={tau} α=0.5 H={h}", executor, tau,
       {**_STREAMING, "outer.overlap_steps": tau})
      for tau in (0, 1, 2) for executor in (("inline",) if tau == 0 else ("thread", "inline"))]


def timeline_run() -> str:
  return f"streaming P=2 τ=2 α=0.5 H={_SYNC_EVERY.value}"


COMMON = {"model.size": "small", "num_replicas": 2, "mesh.replica": 2,
          "eval.every": 100000, "checkpoint.every": 100000, "progress_bar": False}


def sh(*args: str) -> None:
  subprocess.run(args, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def veth_pair():
  """Two namespaces joined by a veth pair; yields a function that (re)shapes both ends.

  gloo connects to the address this host's name resolves to: `ip netns exec` shows each namespace
  its own /etc/netns/<name>/hosts, which maps the name to that namespace's end of the pair.
  """
  for i, ns in enumerate(NAMESPACES):
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # leftovers of a killed run
    sh("ip", "netns", "add", ns)
    hosts = pathlib.Path("/etc/netns") / ns / "hosts"
    hosts.parent.mkdir(parents=True, exist_ok=True)
    hosts.write_text(f"127.0.0.1 localhost\n{ADDRESSES[i]} {socket.gethostname()}\n")
  try:
    sh("ip", "link", "add", "lcj_veth0", "netns", NAMESPACES[0], "type", "veth", "peer", "name",
       "lcj_veth1", "netns", NAMESPACES[1])
    for i, ns in enumerate(NAMESPACES):
      sh("ip", "-n", ns, "addr", "add", f"{ADDRESSES[i]}/30", "dev", f"lcj_veth{i}")
      sh("ip", "-n", ns, "link", "set", f"lcj_veth{i}", "up")
      sh("ip", "-n", ns, "link", "set", "lo", "up")

    def shape(link) -> None:
      """Shapes both directions as `link` (a sim.network.Network), or removes the shaping (None)."""
      for i, ns in enumerate(NAMESPACES):
        dev = ["dev", f"lcj_veth{i}", "root"]
        subprocess.run(["tc", "-n", ns, "qdisc", "del", *dev], capture_output=True)
        if link is None:
          continue
        rate = f"{int(link.bandwidth_bits_per_s)}bit"
        if link.latency_s:
          sh("tc", "-n", ns, "qdisc", "add", *dev, "netem", "delay",
             f"{link.latency_s * 1e6:.0f}us",
             "rate", rate, "limit", "100000")
        else:  # a bucket of 10 ms at the link's rate, and up to 1 s of queue
          burst = max(16384, int(link.bandwidth_bits_per_s / 8 / 100))
          sh("tc", "-n", ns, "qdisc", "add", *dev, "tbf", "rate", rate, "burst", str(burst),
             "latency", "1s")

    yield shape
  finally:
    for ns in NAMESPACES:
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)
      shutil.rmtree(pathlib.Path("/etc/netns") / ns, ignore_errors=True)


def timed_window(workdir: pathlib.Path) -> float:
  times = {m["step"]: m["time"] for m in map(json.loads, (workdir / "metrics.jsonl").open())}
  return times[_STEPS.value] - times[_WARM.value]


def run(changes: dict, workdir: pathlib.Path) -> float:
  import launch_local  # pylint: disable=g-import-not-at-top
  # The shaped run reuses the unshaped run's compiled programs (same config, same programs).
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(tempfile.gettempdir())
                                                         / "lowcomm-slow-link-xla-cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  flags_ = [f"--config={ROOT / 'experiments' / 'configs' / 'diloco.py'}", f"--workdir={workdir}",
            *(f"--config.{k}={v}" for k, v in changes.items())]
  # train.py's command with the worker in its place (same flags; it also writes timeline.json)
  wrap = lambda i, cmd: ["ip", "netns", "exec", NAMESPACES[i], cmd[0], str(WORKER), *cmd[2:]]
  code = launch_local.launch(2, 1, flags_, 20, coordinator_host=ADDRESSES[0], wrap=wrap)
  if code:
    raise RuntimeError(f"the run in {workdir} failed with {code}")
  return timed_window(workdir)


def predicted_window(changes: dict, step_seconds: float) -> float:
  """The virtual clock's time of the same window: the run's collectives on the declared link."""
  from lowcomm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import Trainer  # pylint: disable=g-import-not-at-top
  c = config_lib.override(config_lib.default_config(), {**changes, "mesh.replica": 1,
                                                         "network": _LINK.value})
  with tempfile.TemporaryDirectory() as tmp:
    trainer = Trainer(c, tmp)
    state = trainer.init_state()
    return (trainer.simulated_wall_time(_STEPS.value, step_seconds, state)
            - trainer.simulated_wall_time(_WARM.value, step_seconds, state))


def main(argv):
  del argv
  if _REPLOT.value:
    plot_timelines(json.loads(pathlib.Path(_OUT.value).read_text())["timelines"],
                   _timeline_png())
    return
  from lowcomm_jax.sim import network  # pylint: disable=g-import-not-at-top
  link = network.parse_network(_LINK.value)
  window = _STEPS.value - _WARM.value
  results = {"link": _LINK.value, "steps": _STEPS.value, "warm_steps": _WARM.value,
             "sync_every": _SYNC_EVERY.value, "model": COMMON["model.size"],
             "batch_size": _BATCH.value, "seq_len": _SEQ_LEN.value,
             "rows": []}
  timelines = {}
  with veth_pair() as shape, tempfile.TemporaryDirectory() as tmp:
    for index, (name, executor, tau, extra) in enumerate(runs(_SYNC_EVERY.value)):
      if _TAUS.value is not None and (
        extra["algorithm"] == "diloco" or str(tau) not in _TAUS.value
      ):
        continue
      changes = {**COMMON, **extra, "outer.overlap_executor": executor,
                 "outer.sync_every": _SYNC_EVERY.value,
                 "data.batch_size": _BATCH.value, "data.seq_len": _SEQ_LEN.value,
                 "num_steps": _STEPS.value + 1, "stop_at_step": _STEPS.value,
                 "log_every": _WARM.value}
      shape(None)
      fast = min(run(changes, pathlib.Path(tmp) / f"{index}_fast{i}")
                 for i in range(_UNSHAPED_REPEATS.value))
      shape(link)
      slow_dir = pathlib.Path(tmp) / f"{index}_slow"
      slow = run(changes, slow_dir)
      if name == timeline_run():
        timelines[executor] = json.loads((slow_dir / "timeline.json").read_text())
      clock_s = predicted_window(changes, fast / window)
      results["rows"].append({"run": name, "executor": executor, "tau": tau, "unshaped_s": fast,
                              "shaped_s": slow, "clock_s": clock_s})
      print(f"row: {results['rows'][-1]}", flush=True)
      pathlib.Path(_OUT.value).write_text(json.dumps(results, indent=1))  # each row as it comes
  results["timelines"] = timelines
  pathlib.Path(_OUT.value).write_text(json.dumps(results, indent=1))
  print(f"\nlink {_LINK.value}, steps {_WARM.value + 1}..{_STEPS.value} (2 processes, "
        f"`{COMMON['model.size']}` model)")
  print(f"{'run':30} {'executor':>8} {'unshaped s':>10} {'shaped s':>9} {'clock s':>8} "
        f"{'shaped/clock':>12}")
  for r in results["rows"]:
    print(f"{r['run']:30} {r['executor']:>8} {r['unshaped_s']:10.2f} {r['shaped_s']:9.2f} "
          f"{r['clock_s']:8.2f} {r['shaped_s'] / r['clock_s']:12.2f}")
  if timelines:
    plot_timelines(timelines, _timeline_png())


def _timeline_png() -> pathlib.Path:
  """Beside --out: slow_link.json -> slow_link_timeline.png."""
  out = pathlib.Path(_OUT.value)
  return out.with_name(f"{out.stem}_timeline.png")


def plot_timelines(timelines: dict, path: pathlib.Path) -> None:
  """One lane per executor: each inner step (from the previous step's end to its own), and each
  all-reduce the thread ran (from its dispatch to its result), from the timed window's start: step
  warm_steps + 2's dispatch, after the first metric gather (one step late), which compiles."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(14, 1.2 + 1.1 * len(timelines)))
  for lane, (executor, timeline) in enumerate(sorted(timelines.items())):
    steps = [s for s in timeline["steps"] if _WARM.value + 1 <= s["step"] <= _STEPS.value]
    origin = steps[1]["dispatched_s"]
    steps = [{"step": _WARM.value + 1, "finished_s": origin}] + steps[1:]
    y = 2 * lane
    for before, s in zip(steps, steps[1:]):
      ax.barh(y + 0.5, s["finished_s"] - before["finished_s"], left=before["finished_s"] - origin,
              height=0.8, color="tab:blue" if s["step"] % 2 else "tab:cyan", edgecolor="white")
      ax.text(before["finished_s"] - origin + 0.02, y + 0.5, str(s["step"]), va="center",
              fontsize=6)
    for i in timeline["issued"]:
      if i["started_s"] >= origin and i["step"] <= _STEPS.value:
        ax.barh(y + 1.4, i["finished_s"] - i["started_s"], left=i["started_s"] - origin, height=0.7,
                color="tab:orange" if i["plan"] != "fragment 0" else "tab:red", edgecolor="black")
        ax.text(i["started_s"] - origin + 0.02, y + 1.4, f"Δ{i['fragment']} (step {i['step']})",
                va="center", fontsize=6)
  ax.set_yticks([2 * l + t for l in range(len(timelines)) for t in (0.5, 1.4)])
  ax.set_yticklabels(
    [f"{e}: {what}" for e in sorted(timelines) for what in ("inner steps", "all-reduce (thread)")]
  )
  ax.set_xlabel(f"seconds since step {_WARM.value + 2} was dispatched (process 0)")
  ax.set_title(f"{timeline_run()}, 2 processes, {_LINK.value} link: steps and the executor's "
               f"all-reduces")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  app.run(main)
