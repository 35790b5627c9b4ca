"""experiments/train.py, plus a timeline: process 0 writes <workdir>/timeline.json with when each
step's program finished (`hooks.StepTimes`) and when each of the executor's collectives ran
(`hooks.CommTimeline`), all on this process's `time.perf_counter`. Run by benchmarks/slow_link.py
through launch_local (same flags as train.py)."""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import train as train_script  # pylint: disable=wrong-import-position

from lowcomm_jax import cli, distributed, train  # pylint: disable=wrong-import-position
from lowcomm_jax.train import hooks as hooks_lib  # pylint: disable=wrong-import-position


class TimedTrainer(train.Trainer):

  def run(self, hooks=()):  # pylint: disable=redefined-outer-name
    steps, timeline = hooks_lib.StepTimes(), hooks_lib.CommTimeline()
    summary = super().run(hooks=[*hooks, steps, timeline])
    if distributed.is_primary():
      (self.workdir / "timeline.json").write_text(json.dumps({
          "executor": self.overlap_executor,
          "steps": [{"step": s, "dispatched_s": d, "finished_s": f} for s, d, f in steps.times],
          "issued": [{"step": i.step, "plan": i.name, "submitted_s": i.submitted_s,
                      "started_s": i.started_s, "finished_s": i.finished_s}
                     for i in timeline.issued]}))
    return summary


if __name__ == "__main__":
  train.Trainer = TimedTrainer  # train.py's main builds `lowcomm_jax.train.Trainer`
  cli.run(train_script.main)
