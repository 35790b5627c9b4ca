"""DiLoCo's step-time overhead against a plain optax step of the same per-replica model and batch.

  python benchmarks/diloco_overhead.py [--rounds=7 --steps=10 --sync_every=50]

Measured side by side in one run, alternating rounds (this machine is shared and noisy):
- `dp`: a data-parallel step (plain optax AdamW) of the `small` model, batch 16 × 128, one device;
- `diloco non-sync`: DiLoCo's inner step with M = 1 on one device (same model, batch, AdamW);
- `diloco sync`: DiLoCo's sync step (inner step + outer gradient, mean, outer Nesterov, replace).
Reports the non-sync/dp ratio (contract: ≤ 1.05) and the sync cost amortized over H:
(t_sync − t_non_sync) / H as a fraction of the dp step. Writes
benchmarks/results/diloco_overhead.json.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import pathlib
import statistics
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from lowcomm_jax import config as config_lib
from lowcomm_jax.train import Trainer

_ROUNDS = flags.DEFINE_integer("rounds", 7, "Alternating timed rounds.")
_STEPS = flags.DEFINE_integer("steps", 10, "Steps per round.")
_SYNC_EVERY = flags.DEFINE_integer("sync_every", 50, "H, for the amortized sync cost.")
_OUT = flags.DEFINE_string("out",
                           str(pathlib.Path(__file__).parent / "results" / "diloco_overhead.json"),
                           "Where to write the results.")


def _program(algorithm, sync: bool):
  c = config_lib.default_config()
  c.model.size = "small"
  c.data.batch_size, c.data.seq_len = 16, 128
  c.mesh.data = 1
  if algorithm == "diloco":
    c.algorithm, c.num_replicas, c.outer.sync_every = "diloco", 1, _SYNC_EVERY.value
  trainer = Trainer(c, pathlib.Path(tempfile.mkdtemp()) / "w", devices=jax.devices()[:1])
  state = trainer.init_state()
  step = _SYNC_EVERY.value if sync else 1
  program, entries = trainer.program(trainer.algorithm.phase_at(step), state)
  batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (1, 16, 129), dtype=np.int32),
                         trainer.batch_sharding())
  state, _ = program(state, batch)
  jax.block_until_ready(state)
  return {"program": program, "state": state, "batch": batch, "times": [], "entries": entries}


def main(argv):
  del argv
  setups = {"dp": _program("dp", False), "diloco non-sync": _program("diloco", False),
            "diloco sync": _program("diloco", True)}
  for _ in range(_ROUNDS.value):
    for s in setups.values():
      start = time.perf_counter()
      for _ in range(_STEPS.value):
        s["state"], _ = s["program"](s["state"], s["batch"])
      jax.block_until_ready(s["state"])
      s["times"].append((time.perf_counter() - start) / _STEPS.value)
  med = {k: statistics.median(s["times"]) for k, s in setups.items()}
  # Ratios per round (same moment, same load), then the median of those ratios.
  ratio = statistics.median(a / b for a,
                            b in zip(setups["diloco non-sync"]["times"], setups["dp"]["times"]))
  sync_extra = statistics.median(
      (a - b) / c for a, b,
      c in zip(setups["diloco sync"]["times"], setups["diloco non-sync"]["times"],
                                     setups["dp"]["times"]))
  result = {
      "step_seconds_median": med, "non_sync_over_dp": ratio,
      "sync_extra_over_dp_step": sync_extra, "sync_every": _SYNC_EVERY.value,
      "amortized_sync_over_dp_step": sync_extra / _SYNC_EVERY.value,
      "non_sync_collectives": len(setups["diloco non-sync"]["entries"]),
      "rounds": _ROUNDS.value, "steps_per_round": _STEPS.value,
      "times": {k: s["times"] for k, s in setups.items()},
  }
  print(f"{'program':<18}{'median s/step':>15}")
  for k, v in med.items():
    print(f"{k:<18}{v:>15.4f}")
  print(f"non-sync / dp step: {ratio:.3f} (contract <= 1.05)")
  print(f"sync step extra: {sync_extra:.3f} dp steps; amortized over H={_SYNC_EVERY.value}: "
        f"{result['amortized_sync_over_dp_step']:.4f} dp steps per step")
  pathlib.Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(_OUT.value).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  app.run(main)
