"""What the Trainer's loop does around each step besides the step: hooks.

The loop (`Trainer.run`) is data → the phase's program → the carrier of its outer communication
(`train.overlap`) → hooks. A hook is called

  begin(loop)                               before the first step (`Loop`: what it may read)
  dispatched(step, state, metrics)          once the step's program is dispatched
  after_step(step, phase, state, metrics)   after the carrier's `after_step`; returns the state
  end(state)                                after the last step, the carrier settled
  close()                                   at the end, also when the run stops on an error

in the order of the list. The loop's own are `StepMetrics` (logged one step late), `Refusals`
(config.nonfinite), `Evaluation` and `Checkpoints` (with preemption); a caller adds its own with
`Trainer.run(hooks=[...])`: `StepTimes` (when each step's program finished), `CommTimeline` (the
outer-communication thread's transfers), `FinalState` (the state at the end),
`train.faults.StepFaults` (an elastic learner's faults; the syncer's and the driver's are
`train.faults.SyncerFaults` and `PoissonKills`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax.numpy as jnp

from lowcomm_jax import distributed
from lowcomm_jax.models import config as model_config
from lowcomm_jax.train import metrics as metrics_lib, mfu as mfu_lib


@dataclasses.dataclass
class Loop:
  """What a hook may read of the running loop.

  Attributes:
    trainer: the `Trainer` running it.
    carrier: its outer communication's carrier (`train.overlap`: Inline, Threaded, Remote).
    start: the step this start resumed from (0 for a new run); the first step is start + 1.
    stop: the last step this start runs.
    data_iters: the iterators of this process's replicas.
  """

  trainer: Any
  carrier: Any
  start: int
  stop: int
  data_iters: list

  def data_state(self) -> list:
    """Every replica's data iterator state (a collective with several processes)."""
    return distributed.gather_lists([it.get_state() for it in self.data_iters])


class Hook:
  """Does nothing at every call; a hook overrides what it needs (see the module doc)."""

  def begin(self, loop: Loop) -> None:
    pass

  def dispatched(self, step: int, state, metrics: dict) -> None:
    pass

  def after_step(self, step: int, phase, state, metrics: dict):
    return state

  def end(self, state) -> None:
    pass

  def close(self) -> None:
    pass


class StepMetrics(Hook):
  """The logged metrics (metrics.jsonl, TensorBoard): fetched one step late
  (`metrics.OneStepBehind`), so that logging never makes the host wait for a step before
  dispatching the next; throughput windows end at the fetch. Also the bytes sent, by the ledger.

  `restored` is the checkpoint's record of the starts before this one (sent bytes, timing).
  """

  def __init__(self, trainer, start: int, stop: int, restored: dict):
    c = trainer.config
    self.trainer = trainer
    self.writer = metrics_lib.MetricWriter(trainer.workdir, c.num_steps, start, c.progress_bar,
                                           enabled=distributed.is_primary())
    peak = mfu_lib.run_peak(c.hardware.peak_flops_per_device, trainer.mesh.devices.size,
                            trainer.mesh.devices.flat)
    self.throughput = metrics_lib.Throughput(
        c.num_replicas * c.data.batch_size * c.data.seq_len,
        model_config.flops_per_token(trainer.model_cfg, c.data.seq_len), peak, start,
        restored.get("timing", {}).get("throughput"))
    self.earlier_wall = float(restored.get("timing", {}).get("wall_time_s", 0.0))
    # the ledger's bytes per worker, over the whole run
    self.sent_bytes = restored.get("sent_bytes", 0.0)
    self.peak_sync_bytes = restored.get("peak_sync_bytes", 0.0)
    self.stop = stop
    self.began = time.perf_counter()
    self._behind = metrics_lib.OneStepBehind(trainer.fetch)

  def take_ready(self) -> tuple[int, dict] | None:
    """(step, values) of the held step, fetched now (its throughput window ends here)."""
    record = self._behind.ready()
    if record is None:
      return None
    held_step, values, fetched_at = record
    window = int(values.pop("_window_steps", 0))
    if window:
      values.update(self.throughput.window(held_step, window, fetched_at))
    return held_step, values

  def flush(self) -> None:
    """Writes the held step's line now (before a checkpoint: a resume never loses it)."""
    ready = self.take_ready()
    if ready:
      self.writer.write(*ready)

  def wall_time_s(self) -> float:
    """The run's wall time: the starts before this one, then this one's so far."""
    return self.earlier_wall + time.perf_counter() - self.began

  def after_step(self, step, phase, state, metrics):
    tr = self.trainer
    self.flush()  # the last logged step's metrics, fetched now that this step is queued
    logged = {k: float(tr.fetch(v)) for k, v in tr.algorithm.diagnostics(
        tr.source.opt_state_view(state.opt_state), phase).items()}
    step_bytes = sum(e.sent_bytes for e in tr.phase_entries(phase, state, tr.source.route_at(step)))
    self.sent_bytes += step_bytes
    self.peak_sync_bytes = max(self.peak_sync_bytes, step_bytes)
    self.throughput.count_step()
    log_now = step % tr.config.log_every == 0 or step == self.stop
    if log_now:
      logged["_window_steps"] = self.throughput.take_window_steps()
    if logged:
      self._behind.hold(step, metrics if log_now else {}, logged)
    return state

  def close(self) -> None:
    self.writer.close()


class Refusals(Hook):
  """config.nonfinite after outer steps refused for NaN or inf (`Trainer.check_refused`): read at
  once on a sync step; on a logged step a copy is read one step late (once the next is queued)."""

  def __init__(self, trainer, stop: int):
    self.trainer, self.stop = trainer, stop
    self._pending = None  # (counts, step) of the last logged step

  def flush(self) -> None:
    if self._pending is not None:
      self.trainer.check_refused(*self._pending)
      self._pending = None

  def after_step(self, step, phase, state, metrics):
    tr = self.trainer
    self.flush()
    if tr.algorithm.checks_refusals(phase):  # a sync step: read now
      tr.check_refused(tr.refused_array(state), step)
    elif step % tr.config.log_every == 0 or step == self.stop:
      # a copy (the state is donated to the next step), read after the next step is dispatched
      self._pending = (jnp.copy(tr.refused_array(state)), step)
    return state

  def end(self, state) -> None:
    self.flush()


class Evaluation(Hook):
  """The eval losses every `eval.every` steps and at the last step, on the line of their step."""

  def __init__(self, trainer, step_metrics: StepMetrics, eval_batches: list, splits):
    self.trainer, self.step_metrics = trainer, step_metrics
    self.eval_batches, self.splits = eval_batches, splits
    self.eval_step = trainer.eval_fn()
    self.losses: dict | None = None  # the latest evaluation's

  def evaluate(self, state) -> dict:
    self.losses = self.trainer.evaluate(self.eval_step, state, self.eval_batches, self.splits)
    return self.losses

  def after_step(self, step, phase, state, metrics):
    if step % self.trainer.config.eval.every == 0 or step == self.trainer.config.num_steps:
      m = self.step_metrics
      _, held = m.take_ready() or (step, {})  # evaluating waits for this step anyway
      m.writer.write(step, {**held, **self.evaluate(state)})
      m.throughput.restart()
    return state


class Checkpoints(Hook):
  """Saves every `checkpoint.every` steps, at the last step and at a preemption (SIGTERM), then
  stops a preempted run (`distributed.Preempted`). A checkpoint holds the train state with the
  carrier's results in flight written into it, every replica's data iterator state, the bytes
  sent and the timing so far."""

  def __init__(self, trainer, ckpt, step_metrics: StepMetrics, refusals: Refusals, stop: int):
    self.trainer, self.ckpt, self.stop = trainer, ckpt, stop
    self.step_metrics, self.refusals = step_metrics, refusals
    self.preemption = distributed.Preemption()  # reliability: SIGTERM saves at a step boundary
    self.loop = None

  def begin(self, loop: Loop) -> None:
    self.loop = loop

  def after_step(self, step, phase, state, metrics):
    preempted = self.preemption.reached(step)  # reliability: every process, every step
    saving = step % self.trainer.config.checkpoint.every == 0 or step == self.stop or preempted
    self.ckpt.check(saving)  # reliability: a failed save stops the run at once, in one line
    if saving:
      if self.trainer.config.nonfinite == "raise":  # never save past a refusal
        self.refusals.flush()
      self.step_metrics.flush()  # written before the checkpoint: a resume never loses its line
      state = self.loop.carrier.settle(state)  # the checkpoint holds the in-flight results
      self.loop.carrier.quiet()
      m = self.step_metrics
      timing = {"wall_time_s": m.wall_time_s(), "throughput": m.throughput.totals()}
      self.ckpt.save(step, state, {"replicas": self.loop.data_state(), "timing": timing,
                                   "sent_bytes": m.sent_bytes,
                                   "peak_sync_bytes": m.peak_sync_bytes})
    if preempted and step < self.stop:  # reliability: saved; stop with a message
      self.loop.carrier.close()
      self.close()
      raise distributed.Preempted(step, self.ckpt.directory)
    return state

  def close(self) -> None:
    self.preemption.close()
    self.ckpt.close()  # a save in flight is finished and sealed, never abandoned


class StepTimes(Hook):
  """When each step's program finished on this process (`metrics.StepTimes`): `times` holds
  (step, dispatched_s, finished_s) once the run ended."""

  def __init__(self):
    self.times: list = []
    self._watch = None

  def begin(self, loop: Loop) -> None:
    self._watch = metrics_lib.StepTimes()

  def dispatched(self, step, state, metrics) -> None:
    self._watch.watch(step, [metrics["loss"]])

  def close(self) -> None:
    if self._watch is not None:
      self.times, self._watch = self._watch.close(), None


class CommTimeline(Hook):
  """The outer-communication thread's transfers of the run (`comm.Issued`; none inline)."""

  def __init__(self):
    self.issued: list = []
    self._carrier = None

  def begin(self, loop: Loop) -> None:
    self._carrier = loop.carrier

  def end(self, state) -> None:
    executor = getattr(self._carrier, "executor", None)
    self.issued = list(executor.issued) if executor else []


class FinalState(Hook):
  """The train state after the last step (`state`) and the data iterators' (`data_state`)."""

  def __init__(self):
    self.state = None
    self.data_state = None
    self._loop = None

  def begin(self, loop: Loop) -> None:
    self._loop = loop

  def end(self, state) -> None:
    self.state = state
    self.data_state = self._loop.data_state()


def close_quietly(hooks) -> None:
  """Closes every hook, the first error aside: the error that stopped the run is the one to
  report."""
  for hook in hooks:
    try:
      hook.close()
    except Exception:  # pylint: disable=broad-except
      pass
