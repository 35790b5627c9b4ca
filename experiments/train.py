"""Trains a model as a config file says.

  python experiments/train.py --config=experiments/configs/dp.py --workdir=runs/dp
  python experiments/train.py --config=experiments/configs/dp.py:tiny --workdir=runs/tiny \
      --config.num_steps=50

Outputs go to the workdir (metrics.jsonl, tensorboard/, checkpoints/, summary.json);
rerunning the same command resumes from the last checkpoint.

Several processes (one per host, or experiments/launch_local.py on one machine) run the same
command plus --coordinator_address, --num_processes and --process_id; under SLURM, Open MPI or on a
TPU pod slice JAX reads those from the environment (see the README's "Multi-host" section).
"""

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.", required=True)
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", ["auto", "on", "off"],
    "Multi-process runtime: on always joins (JAX detects TPU pod slices, SLURM, Open MPI when the "
    "flags below are not given); auto joins when they are given, JAX_COORDINATOR_ADDRESS is set or "
    "SLURM/Open MPI report several tasks; off runs one process.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0's coordinator (all processes the same).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from lowcomm_jax import config as config_lib, distributed  # after flag parsing
  config = _CONFIG.value
  config_lib.validate(config)  # bad values fail before any process waits for another
  distributed.initialize(_DISTRIBUTED.value, _COORDINATOR.value, _NUM_PROCESSES.value,
                         _PROCESS_ID.value, config.distributed.timeout_seconds,
                         config.distributed.init_timeout_seconds)
  from lowcomm_jax import train  # pylint: disable=g-import-not-at-top
  summary = train.run(config, _WORKDIR.value)
  if not distributed.is_primary():
    return
  if summary["final_eval_loss"] is None:  # stopped early (stop_at_step): no summary.json yet
    print(f"stopped after step {summary['steps']}, wall {summary['wall_time_s']:.0f} s; rerun "
          "without --config.stop_at_step to go on")
    return
  print(f"final eval loss {summary['final_eval_loss']:.4f}, "
        f"{summary['tokens_per_s']:.0f} tokens/s, wall {summary['wall_time_s']:.0f} s")
  print(f"summary: {summary['workdir']}/summary.json")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
