"""Trains NoLoCo or DiLoCo across replicas with a pipeline inside each step, on a (replica, stage) mesh.

  python experiments/pipeline.py --config=experiments/configs/noloco_pipeline.py --workdir=runs/nlp
  python experiments/pipeline.py --config=experiments/configs/noloco_pipeline.py:diloco \
      --workdir=runs/dlp

Runs on 8 fake CPU devices when no accelerator is set up (XLA_FLAGS is set here, before jax
starts, unless already given). Writes config.json, metrics.jsonl (one object per step; eval loss
and weight spread on eval steps) and summary.json into the workdir. No checkpoints: a rerun in the same
workdir is refused, leaving the earlier run's files as they were.
"""

import json
import os
import pathlib

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.", required=True)


def main(argv):
  del argv
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  from lowcomm_jax.parallel import combined  # pylint: disable=g-import-not-at-top
  workdir = pathlib.Path(_WORKDIR.value)
  config = _CONFIG.value
  combined.validate_config(config)  # bad input fails before anything is written
  if (workdir / "config.json").exists():
    # Pipeline runs keep no checkpoints, so a rerun would overwrite the earlier run's outputs.
    raise ValueError(f"--workdir={workdir} already holds a pipeline run (pipeline runs do not "
                     "resume); choose a new --workdir")
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(config.to_json(indent=1))
  with open(workdir / "metrics.jsonl", "w") as metrics:
    result = combined.train(config, on_metrics=lambda row: metrics.write(json.dumps(row) + "\n"))
  (workdir / "summary.json").write_text(json.dumps(result.summary, indent=1))
  print(f"final eval loss {result.summary['final_eval_loss']:.4f} (fixed routing, mean of "
        f"{result.summary['num_replicas']} replicas), wall {result.summary['wall_seconds']:.0f} s")
  print(f"summary: {workdir}/summary.json")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
