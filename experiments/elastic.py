"""Trains with elastic learners on Ray: DiLoCo that keeps going while learners fail or straggle.

  python experiments/elastic.py --config=experiments/configs/elastic.py:tiny --workdir=runs/elastic

Starts a local Ray on 127.0.0.1 (or joins the cluster `--config.elastic.address` names), a syncer
and `elastic.num_learners` learners (docs/elastic.md). Outputs in the workdir: config.json,
metrics.jsonl and tensorboard/ (per fragment round: participation, loss; the final eval loss),
summary.json (goodput, participation, rejoin times, faults, bytes per learner), syncer/checkpoints/
(φ and the outer optimizer state), learners/<i>/ (each learner's loss, timeline and counts).
Rerunning the same command resumes from the syncer's checkpoint (`--config.stop_at_step=S` stops
every learner at step S; `--config.elastic.num_learners` may change on resume). To add and remove
learners while the run goes on, call `lowcomm_jax.elastic.start` from Python (docs/elastic.md).
"""

import sys

from absl import flags, logging
from ml_collections import config_flags

from lowcomm_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.", required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  try:
    summary = elastic.run(_CONFIG.value, _WORKDIR.value)
  except workdir_lib.WorkdirInUse as error:
    sys.exit(f"ValueError: {error}")
  except TimeoutError as error:
    sys.exit(f"TimeoutError: {error}")
  if summary.get("complete_before_start"):
    return
  if summary.get("complete") is False:  # stop_at_step
    print(f"stopped at step {summary['step']} (rounds {summary['rounds']}); the same command "
          f"resumes {summary['workdir']}")
    return
  rejoin = summary["rejoin_s"]
  print(f"final eval loss {summary['final_eval_loss']:.4f}, goodput {summary['goodput']:.3f}, "
        f"participation {summary['participation']:.3f}, {len(summary['deaths'])} deaths"
        + (f", median rejoin {sorted(rejoin)[len(rejoin) // 2]:.1f} s" if rejoin else "")
        + f", wall {summary['wall_time_s']:.0f} s")
  print(f"summary: {summary['workdir']}/summary.json")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  cli.run(main)
