"""Trains a model as a config file says.

  python experiments/train.py --config=experiments/configs/dp.py --workdir=runs/dp
  python experiments/train.py --config=experiments/configs/dp.py:tiny --workdir=runs/tiny \
      --config.num_steps=50

Outputs go to the workdir (metrics.jsonl, tensorboard/, checkpoints/, summary.json);
rerunning the same command resumes from the last checkpoint.
"""

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.", required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from lowcomm_jax import train  # after flag parsing: bad flags fail before jax starts
  summary = train.run(_CONFIG.value, _WORKDIR.value)
  print(f"final eval loss {summary['final_eval_loss']:.4f}, "
        f"{summary['tokens_per_s']:.0f} tokens/s, wall {summary['wall_time_s']:.0f} s")
  print(f"summary: {summary['workdir']}/summary.json")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
