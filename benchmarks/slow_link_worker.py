"""experiments/train.py, plus a timeline: process 0 writes <workdir>/timeline.json with when each
step's program finished (`Trainer.step_times`) and when each of the executor's collectives ran
(`Trainer.comm_issued`), all on this process's `time.perf_counter`. Run by benchmarks/slow_link.py
through launch_local (same flags as train.py)."""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import train as train_script  # pylint: disable=wrong-import-position

from lowcomm_jax import cli, distributed, train  # pylint: disable=wrong-import-position


class TimedTrainer(train.Trainer):

  def run(self):
    self.watch_steps = True
    summary = super().run()
    if distributed.is_primary():
      (self.workdir / "timeline.json").write_text(json.dumps({
          "executor": self.overlap_executor,
          "steps": [{"step": s, "dispatched_s": d, "finished_s": f} for s, d, f in self.step_times],
          "issued": [{"step": i.step, "plan": i.name, "submitted_s": i.submitted_s,
                      "started_s": i.started_s, "finished_s": i.finished_s}
                     for i in self.comm_issued]}))
    return summary


if __name__ == "__main__":
  train.Trainer = TimedTrainer  # train.py's main builds `lowcomm_jax.train.Trainer`
  cli.run(train_script.main)
