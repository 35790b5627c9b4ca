"""One process of the two-process legs of tests/test_engine.py and tests/test_overlap_loop.py (run
by launch_local.py --script, never imported by a test).

  python experiments/launch_local.py --num_processes=2 --script=tests/engine_processes_worker.py \
      -- --out=DIR [--leg=engine|overlap]

Joins the others through jax.distributed once, then trains every run of the leg in turn with the
one Trainer (one launch: the processes start and import JAX once for all runs), each in
DIR/<name>, and prints which overlap executor each ran (`<name>: done, overlap executor thread`).
The engine leg trains every case of lowcomm_jax.testing.PROCESS_CASES, and process 0 writes every
replica's final parameters to DIR/<case>.npz, keyed by parameter path; the overlap leg trains
lowcomm_jax.testing.overlap_leg_configs(), each saved in its orbax checkpoint at the end.
"""

import pathlib

import jax
import numpy as np
from absl import app, flags, logging

from lowcomm_jax import distributed, testing
from lowcomm_jax.testing import PROCESS_CASES, overlap_leg_configs, process_leg_config
from lowcomm_jax.train import Trainer

_OUT = flags.DEFINE_string("out", None, "Directory of the runs and the .npz files.", required=True)
_LEG = flags.DEFINE_enum("leg", "engine", ["engine", "overlap"], "Which runs to train.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distributed.initialize("on", _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                         timeout_seconds=30, init_timeout_seconds=120)
  out = pathlib.Path(_OUT.value)
  configs = (overlap_leg_configs(_NUM_PROCESSES.value) if _LEG.value == "overlap" else
             {case: process_leg_config(case, _NUM_PROCESSES.value) for case in PROCESS_CASES})
  for case, config in configs.items():
    trainer = Trainer(config, out / case)
    _, trainer_final = testing.run_to_end(trainer)
    if _LEG.value == "engine":
      params = distributed.fetch(trainer_final.state.params)  # every process takes part
      if distributed.is_primary():
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        np.savez(out / f"{case}.npz", **{jax.tree_util.keystr(k): v for k, v in leaves})
    print(f"{case}: done, overlap executor {trainer.overlap_executor}", flush=True)


if __name__ == "__main__":
  app.run(main)
