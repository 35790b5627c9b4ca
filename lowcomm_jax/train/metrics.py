"""Run outputs: metrics.jsonl (one object per logged step), TensorBoard events, progress on a
terminal."""

from __future__ import annotations

import json
import pathlib
import queue
import sys
import threading
import time
from typing import Callable

import numpy as np
from tensorboardX import SummaryWriter

from lowcomm_jax.train import workdir as workdir_lib


class StepTimes:
  """When each step's program finished on this process, for timelines (benchmarks/slow_link.py).

  A thread waits on each step's output (this process's shards only: no collective) and records
  `time.perf_counter()`; `times` is [(step, dispatched_s, finished_s)] once `close()` returned.
  """

  def __init__(self):
    self.times: list[tuple[int, float, float]] = []
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._thread = threading.Thread(target=self._wait, name="lowcomm-step-times", daemon=True)
    self._thread.start()

  def watch(self, step: int, output) -> None:
    self._queue.put((step, time.perf_counter(), output))

  def _wait(self) -> None:
    while (item := self._queue.get()) is not None:
      step, dispatched, output = item
      for x in output:
        for shard in x.addressable_shards:
          shard.data.block_until_ready()
      self.times.append((step, dispatched, time.perf_counter()))

  def close(self) -> list[tuple[int, float, float]]:
    self._queue.put(None)
    self._thread.join()
    return self.times


class OneStepBehind:
  """Holds a logged step's device metrics and fetches them after the next step is dispatched.

  Fetching step t's loss right after dispatching step t makes the host wait for step t to end
  before it can prepare and dispatch step t + 1, so the device idles between steps. Held one step
  (as nanodo does), the fetch happens with step t + 1 already queued: no device→host sync on a
  non-logging step, and none that stalls the device on a logging one. Each fetched record carries
  the time its values became available, which is when step t had ended: the honest end of a
  throughput window (the time of a dispatch is not, dispatch runs ahead).
  """

  def __init__(self, fetch: Callable, clock: Callable[[], float] = time.perf_counter):
    self._fetch, self._clock, self._held = fetch, clock, None

  def hold(self, step: int, device_metrics: dict, host_metrics: dict | None = None) -> None:
    """Holds step's metrics (one step at a time: fetch the previous one with `ready` first)."""
    if self._held is not None:
      raise RuntimeError(f"step {self._held[0]}'s metrics are still held; call ready() first")
    self._held = (step, device_metrics, dict(host_metrics or {}))

  def ready(self) -> tuple[int, dict, float] | None:
    """(step, host values, time they were fetched) of the held step, fetched now; or None."""
    if self._held is None:
      return None
    step, device_metrics, host_metrics = self._held
    self._held = None
    values = {k: float(np.mean(v)) for k, v in self._fetch(device_metrics).items()}
    return step, {**values, **host_metrics}, self._clock()


class Throughput:
  """Throughput windows timed on both clocks: wall (tokens_per_s) and this process's CPU-seconds
  (the MFU on CPU, where other processes' load must not count; train/mfu.py). A window ends when
  its last step's metrics are fetched (`OneStepBehind`); the window holding the run's first step
  (it compiles) is logged but left out of the run's totals."""

  def __init__(self, tokens_per_step: int, flops_per_token: float, peak, first_step: int,
               earlier: dict | None = None):
    self._tokens, self._flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
    self._first = first_step
    # the timed windows' totals over the whole run: the starts before this one (`earlier`, as
    # `totals()` gave them when the checkpoint this start resumes from was saved), then this one's
    earlier = earlier or {}
    self.steps, self.seconds = int(earlier.get("steps", 0)), float(earlier.get("seconds", 0.0))
    self.cpu_seconds = float(earlier.get("cpu_seconds", 0.0))
    self._earlier_steps, self._earlier_seconds = self.steps, self.seconds
    self.restart()

  def totals(self) -> dict:
    """The whole run's timed steps and seconds so far (saved with a checkpoint)."""
    return {"steps": self.steps, "seconds": self.seconds, "cpu_seconds": self.cpu_seconds}

  @property
  def start_tokens_per_s(self) -> float:
    """This start's timed windows alone (NaN where none was timed)."""
    seconds = self.seconds - self._earlier_seconds
    return (self.steps - self._earlier_steps) * self._tokens / seconds if seconds else float("nan")

  def restart(self) -> None:
    """A new window starts now (after work that is not the steps', e.g. an evaluation).

    The steps counted since the last logged step ran before this restart, outside the window's
    clocks, so they leave the window: counted, a window after an evaluation that falls between two
    logged steps reported the tokens of all its steps over the time of the last few (2x the rate
    with eval.every = 150, log_every = 20) and the run's totals grew the same way.
    """
    self._wall, self._cpu = time.perf_counter(), time.process_time()
    self._window_steps = 0

  def count_step(self) -> None:
    """One more step in the current window."""
    self._window_steps += 1

  def take_window_steps(self) -> int:
    """The steps of the window ending at the step being logged; the next window counts from 0."""
    steps, self._window_steps = self._window_steps, 0
    return steps

  def window(self, last_step: int, num_steps: int, fetched_at: float) -> dict:
    """The logged values of the window of `num_steps` steps ending at `last_step`, whose metrics
    were fetched at `fetched_at` (perf_counter); the next window starts there."""
    fetched_cpu = time.process_time()
    elapsed, elapsed_cpu = fetched_at - self._wall, fetched_cpu - self._cpu
    if last_step - num_steps > self._first:
      self.steps += num_steps
      self.seconds += elapsed
      self.cpu_seconds += elapsed_cpu
    tokens = num_steps * self._tokens
    values = {"tokens_per_s": tokens / elapsed}
    if self.peak.clock == "cpu":
      values["tokens_per_cpu_s"] = tokens / elapsed_cpu
    values["mfu"] = self.peak.mfu(tokens * self._flops_per_token, elapsed, elapsed_cpu)
    self._wall, self._cpu = fetched_at, fetched_cpu
    return values

  @property
  def tokens_per_s(self) -> float:
    return self.steps * self._tokens / self.seconds if self.seconds else float("nan")

  def summary(self) -> dict:
    """The run's totals over the timed windows (NaN where no step was timed)."""
    timed, tokens = bool(self.seconds), self.steps * self._tokens
    out = {"mfu": (self.peak.mfu(tokens * self._flops_per_token, self.seconds, self.cpu_seconds)
                   if timed else float("nan")),
           "mfu_clock": self.peak.clock, "peak_flops": self.peak.flops_per_second}
    if self.peak.clock == "cpu":
      out["tokens_per_cpu_s"] = tokens / self.cpu_seconds if timed else float("nan")
      out["peak_flops_per_cpu_s"] = self.peak.flops_per_cpu_second
    return out


class MetricWriter:
  """Writes each logged step to metrics.jsonl and TensorBoard; shows a bar or plain lines.

  Disabled (`enabled=False`: every process of a multi-process run but the first), it writes and
  prints nothing, so a run directory holds one copy of each.
  """

  def __init__(self, workdir: pathlib.Path, num_steps: int, start_step: int, progress_bar: bool,
               enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    self.path = pathlib.Path(workdir) / "metrics.jsonl"
    self._truncate_after(start_step)
    self._file = self.path.open("a")
    # Steps up to the checkpoint a resumed run starts from stay logged (as in metrics.jsonl); the
    # ones after it, which the run replays, are purged from what TensorBoard shows.
    self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"),
                             purge_step=start_step + 1 if start_step else None)
    self._bar = None
    if progress_bar and sys.stderr.isatty():
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm(total=num_steps, initial=start_step, unit="step", dynamic_ncols=True)
    self._last_step = start_step

  def _truncate_after(self, step: int) -> None:
    # A resumed run replays the steps after its checkpoint; keep each step logged once. The file is
    # replaced whole (a crash now leaves the old one), and a line a crash tore is dropped, logged.
    if not self.path.exists():
      return
    kept = []
    for number, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
      try:
        record = json.loads(line) if line else None
        logged_step = record["step"] if record is not None else None
      except (ValueError, TypeError, KeyError):
        print(f"{self.path}: line {number} is not a logged step (a write cut short); dropped: "
              f"{line[:80]!r}", flush=True)
        continue
      if logged_step is not None and logged_step <= step:
        kept.append(line)
    workdir_lib.write_atomic(self.path, "".join(l + "\n" for l in kept))

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for k, v in metrics.items():
      self._tb.add_scalar(k, float(v), step)
    text = " ".join(f"{k}={float(v):.4g}" for k, v in metrics.items())
    if self._bar is not None:
      self._bar.update(step - self._last_step)
      self._bar.set_postfix_str(text)
    else:
      print(f"step {step}: {text}", flush=True)
    self._last_step = step

  def close(self) -> None:
    if not self.enabled:
      return
    self._file.close()
    self._tb.close()
    if self._bar is not None:
      self._bar.close()
