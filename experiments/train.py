"""Trains a model as a config file says.

  python experiments/train.py --config=experiments/configs/dp.py --workdir=runs/dp
  python experiments/train.py --config=experiments/configs/dp.py:tiny --workdir=runs/tiny \
      --config.num_steps=50

Outputs go to the workdir (config.json, tokenizer/, metrics.jsonl, tensorboard/, checkpoints/,
summary.json);
rerunning the same command resumes from the last checkpoint.

Several processes (one per host, or experiments/launch_local.py on one machine) run the same
command plus --coordinator_address, --num_processes and --process_id; under SLURM, Open MPI or on a
TPU pod slice JAX reads those from the environment (see the README's "Multi-host" section).
"""

import sys

from absl import flags, logging
from ml_collections import config_flags

from lowcomm_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (path[:variant]).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory.", required=True)
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", ["auto", "on", "off"],
    "Multi-process runtime: on always joins (JAX detects TPU pod slices, SLURM, Open MPI when the "
    "flags below are not given); auto joins when they are given, JAX_COORDINATOR_ADDRESS is set, "
    "SLURM/Open MPI report several tasks or this host is one of a multi-host TPU pod slice; off "
    "runs one process. One process per node (SLURM, Open MPI) uses every local GPU "
    "(docs/clusters.md).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0's coordinator (all processes the same).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "This process's index in [0, num_processes).")
_BIND = flags.DEFINE_string(
    "coordinator_bind_address", None,
    "host:port process 0's coordinator listens on; default the host of --coordinator_address "
    "(e.g. 127.0.0.1 stays loopback). 0.0.0.0:PORT listens on every interface.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from lowcomm_jax import distributed  # after flag parsing
  config = _CONFIG.value
  from lowcomm_jax.train import validation, workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  # Bad values fail before any process waits for another, in one line (cli.run shows the
  # ValueError); the Trainer below takes the checked configuration.
  config = validation.validate(config)
  workdir_lib.check_path(_WORKDIR.value)
  try:  # bad flags, an unreachable coordinator, a failed join: one line naming the flag
    distributed.initialize(_DISTRIBUTED.value, _COORDINATOR.value, _NUM_PROCESSES.value,
                           _PROCESS_ID.value, config.distributed.timeout_seconds,
                           config.distributed.init_timeout_seconds, _BIND.value)
  except RuntimeError as error:
    sys.exit(f"RuntimeError: {error}")
  from lowcomm_jax import train  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.codecs import NonFiniteError  # pylint: disable=g-import-not-at-top
  trainer = None
  try:
    trainer = train.Trainer(config, _WORKDIR.value)
    summary = trainer.run()
  except distributed.Preempted as stopped:
    print(stopped, flush=True)
    sys.exit(distributed.PREEMPTED_EXIT_CODE)
  except workdir_lib.WorkdirInUse as error:  # another start holds the workdir: nothing was changed
    sys.exit(f"ValueError: {error}")
  except train.checkpoint.SaveFailed as error:  # the line names the step, the path, the OS error
    sys.exit(f"SaveFailed: {error}")
  except NonFiniteError as error:  # nonfinite=raise: the step and what held NaN or inf, in one line
    sys.exit(f"NonFiniteError: {error}")
  except ValueError as error:
    # A refused start (config, workdir, data checks: nothing written) is one line (cli.run); once
    # the run has begun it is no input of the user's but a failure to trace back.
    if trainer is None or not (trainer.resuming or (trainer.workdir / "config.json").exists()):
      raise
    raise RuntimeError(f"the run in {_WORKDIR.value} failed: {error}") from error
  if not distributed.is_primary() or summary.get("complete_before_start"):
    return
  if summary["steps"] < config.num_steps:  # stopped early (stop_at_step): no summary.json yet
    print(f"stopped after step {summary['steps']}, wall {summary['wall_time_s']:.0f} s; rerun "
          "without --config.stop_at_step to go on")
    return
  number = lambda key, form: "n/a" if summary[key] is None else format(summary[key], form)
  print(f"final eval loss {number('final_eval_loss', '.4f')}, "
        f"{number('tokens_per_s', '.0f')} tokens/s, wall {summary['wall_time_s']:.0f} s")
  print(f"summary: {summary['workdir']}/summary.json")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  cli.run(main)
