"""One process of the battery's two-process leg (tests/test_engine.py; run by launch_local.py
--script, never imported by a test).

  python experiments/launch_local.py --num_processes=2 --script=tests/engine_processes_worker.py \
      -- --out=DIR

Joins the others through jax.distributed once, then trains every case of
lowcomm_jax.testing.PROCESS_CASES in turn with the one Trainer (one launch: the processes start and
import JAX once for all algorithms), each in DIR/<case>; process 0 writes every replica's final
parameters to DIR/<case>.npz, keyed by parameter path, and prints which overlap executor each case
ran (`<case>: done, overlap executor thread`).
"""

import pathlib

import jax
import numpy as np
from absl import app, flags, logging

from lowcomm_jax import distributed
from lowcomm_jax.testing import PROCESS_CASES, process_leg_config
from lowcomm_jax.train import Trainer

_OUT = flags.DEFINE_string("out", None, "Directory of the runs and the .npz files.", required=True)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  distributed.initialize("on", _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                         timeout_seconds=30, init_timeout_seconds=120)
  out = pathlib.Path(_OUT.value)
  for case in PROCESS_CASES:
    trainer = Trainer(process_leg_config(case, _NUM_PROCESSES.value), out / case)
    trainer.run()
    params = distributed.fetch(trainer.final_state.params)  # every process takes part
    if distributed.is_primary():
      leaves = jax.tree_util.tree_flatten_with_path(params)[0]
      np.savez(out / f"{case}.npz", **{jax.tree_util.keystr(k): v for k, v in leaves})
    print(f"{case}: done, overlap executor {trainer.overlap_executor}", flush=True)


if __name__ == "__main__":
  app.run(main)
