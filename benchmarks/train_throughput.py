"""Train-step throughput of the `small` model: 1 CPU device against the 8-fake-device mesh, side by
side.

  python benchmarks/train_throughput.py [--steps=10 --rounds=5]

Both setups are compiled first, then timed in alternating rounds so that load on this shared machine
hits both alike; the table reports the median tokens/s per setup, the ratio to the 1-device baseline
and the Trainer's MFU (train/mfu.py: on CPU, model FLOPs per process CPU-second over a float32
matmul's FLOPs per CPU-second measured in the same run; the 8 fake devices share the same cores, so
their MFU uses the same host peak). Writes benchmarks/results/train_throughput.json.
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
from lowcomm_jax.models import flops_per_token
from lowcomm_jax.train import Trainer, mfu

_STEPS = flags.DEFINE_integer("steps", 10, "Train steps per timed round.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Alternating timed rounds per setup.")
_OUT = flags.DEFINE_string("out",
                           str(pathlib.Path(__file__).parent / "results" / "train_throughput.json"),
                           "Where to write the results.")


def _setup(name, devices, mesh):
  c = config_lib.default_config()
  c.model.size = "small"
  c.data.batch_size, c.data.seq_len = 16, 128
  for axis, size in mesh.items():
    c.mesh[axis] = size
  trainer = Trainer(c, pathlib.Path(tempfile.mkdtemp()) / name, devices=devices)
  state = trainer.init_state()
  train_step, _ = trainer.program(None, state)
  rng = np.random.default_rng(0)
  batch = jax.device_put(rng.integers(0, 256, (1, 16, 129), dtype=np.int32),
                         trainer.batch_sharding())
  state, _ = train_step(state, batch)  # compile
  jax.block_until_ready(state)
  return {"trainer": trainer, "step": train_step, "state": state, "batch": batch, "rates": [],
          "mfus": []}


def main(argv):
  del argv
  setups = {"1 device": _setup("one", jax.devices()[:1], {"data": 1}),
            "8 devices (data=8)": _setup("eight", jax.devices()[:8], {"data": 8})}
  peak = mfu.run_peak(0.0, 8)  # the whole host, as the Trainer's MFU
  tokens_per_step = 16 * 128
  fpt = flops_per_token(setups["1 device"]["trainer"].model_cfg, 128)
  for _ in range(_ROUNDS.value):
    for s in setups.values():
      start, cpu_start = time.perf_counter(), time.process_time()
      for _ in range(_STEPS.value):
        s["state"], _ = s["step"](s["state"], s["batch"])
      jax.block_until_ready(s["state"])
      wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
      s["rates"].append(_STEPS.value * tokens_per_step / wall)
      s["mfus"].append(peak.mfu(_STEPS.value * tokens_per_step * fpt, wall, cpu))
  base = statistics.median(setups["1 device"]["rates"])
  rows = []
  print(f"{'setup':<22}{'tokens/s':>12}{'ratio':>8}{'MFU':>8}")
  for name, s in setups.items():
    rate = statistics.median(s["rates"])
    row = {"setup": name, "tokens_per_s": rate, "ratio_to_1_device": rate / base,
           "mfu_vs_host_matmul": statistics.median(s["mfus"]), "rates": s["rates"]}
    rows.append(row)
    print(f"{name:<22}{rate:>12.0f}{rate / base:>8.2f}{row['mfu_vs_host_matmul']:>8.3f}")
  result = {"model": "small", "params": setups["1 device"]["trainer"].num_params,
            "flops_per_token": fpt, "host_matmul_flops": peak.flops_per_second,
            "mfu_clock": peak.clock,
            "host_matmul_flops_per_cpu_second": peak.flops_per_cpu_second,
            "tokens_per_step": tokens_per_step,
            "steps_per_round": _STEPS.value, "rounds": _ROUNDS.value, "rows": rows}
  pathlib.Path(_OUT.value).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(_OUT.value).write_text(json.dumps(result, indent=1))
  print(f"host matmul peak {peak.flops_per_second / 1e9:.1f} GFLOP/s ({peak.clock} clock); "
        f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
