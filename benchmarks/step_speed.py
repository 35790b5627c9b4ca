"""Speed of the training step per CPU-second: the Trainer's step against a plain jitted optax step.

  nice -n 10 python benchmarks/step_speed.py [--rounds=7 --steps=5 --dtype=float32]

Setups, all on the `small` model (1,345,152 parameters), batch 16 × 128, one CPU device:
- `trainer`: the Trainer's compiled data-parallel program (`Trainer.program`), as `run()` calls it;
- `plain jit`: a hand-written `jax.jit` of `value_and_grad` + the same optax transformation
  (clipped AdamW with the config's schedule), donating its state, no Trainer;
- `trainer, layer_loop=scan`: the Trainer with the layer loop scanned instead of unrolled (the
  unrolling's share of the step).
Each timed round runs every setup in turn (this machine is shared: rounds interleave so that
load hits all alike); a round also re-measures the host's float32 matmul peak (train/mfu.py).
Figures are process CPU-seconds per step (`time.process_time`: every XLA thread counts, other
processes' load does not), tokens per CPU-second, and medians of per-round ratios:
`overhead_vs_plain_jit` = trainer CPU-s per step ÷ plain jit's, `mfu_small` = the trainer's model
FLOPs per CPU-second ÷ the host matmul's FLOPs per CPU-second.

Peers (torchft's DiLoCo, MaxText's step) run in their own virtual environments; none is run by
this script yet, and the JSON says so (`torchft_ratio`, `maxtext_ratio` are null with a reason).
Writes benchmarks/results/step_speed.json and step_speed.png (tokens per CPU-second per setup).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # pylint: disable=g-import-not-at-top,wrong-import-position
import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import pathlib
import statistics
import tempfile
import time

import jax
import numpy as np
import optax
from absl import app, flags

from lowcomm_jax import config as config_lib
from lowcomm_jax.models import flops_per_token
from lowcomm_jax.train import Trainer, mfu
from lowcomm_jax.train import step as step_lib

_ROUNDS = flags.DEFINE_integer("rounds", 7, "Interleaved timed rounds.")
_STEPS = flags.DEFINE_integer("steps", 5, "Steps per setup per round.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Activation dtype.")
_OUT = flags.DEFINE_string("out", str(pathlib.Path(__file__).parent / "results" / "step_speed.json"),
                           "Where to write the results (the chart goes beside it, .png).")
_BATCH, _SEQ = 16, 128


def _config(layer_loop: str | None):
  c = config_lib.default_config()
  c.model.size, c.model.dtype = "small", _DTYPE.value
  c.data.batch_size, c.data.seq_len = _BATCH, _SEQ
  c.mesh.data = 1
  if layer_loop is not None:  # an older checkout (the "before" run) has no layer_loop key
    c.model.layer_loop = layer_loop
  return c


def _trainer_setup(layer_loop=None):
  trainer = Trainer(_config(layer_loop), pathlib.Path(tempfile.mkdtemp()) / "w",
                    devices=jax.devices()[:1])
  state = trainer.init_state()
  program, _ = trainer.program(None, state)
  batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (1, _BATCH, _SEQ + 1), dtype=np.int32),
                         trainer.batch_sharding())
  run = lambda s: program(s, batch)[0]
  return {"run": run, "state": run(run(state)), "trainer": trainer}  # twice: the output's types


def _plain_setup(trainer):
  """value_and_grad + the same optax transformation, jitted by hand."""
  c = trainer.config
  tx = step_lib.make_optimizer(c.optimizer, c.num_steps)
  graphdef, params = trainer.graphdef, jax.device_get(trainer.init_state().params)
  params = jax.tree.map(lambda a: a[0], params)  # the Trainer's state has a replica axis (here 1)

  @functools.partial(jax.jit, donate_argnums=0)  # the state is updated in place, as the Trainer's
  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: step_lib.lm_loss(graphdef, p, batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (_BATCH, _SEQ + 1), dtype=np.int32),
                         jax.devices()[0])
  params = jax.device_put(params, jax.devices()[0])
  run = lambda s: step(s, batch)[:2]
  # Twice, so a retrace on the step's own output types happens before any timing.
  return {"run": run, "state": run(run((params, tx.init(params))))}


def _time_round(setup, steps):
  state = setup["state"]
  jax.block_until_ready(state)
  cpu, wall = time.process_time(), time.perf_counter()
  for _ in range(steps):
    state = setup["run"](state)
  jax.block_until_ready(state)
  setup["state"] = state
  return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def _chart(rates: dict, path: pathlib.Path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 3))
  names = list(rates)
  ax.barh(names, [rates[n] for n in names], color="tab:blue")
  ax.set_xlabel("tokens per process CPU-second (median of rounds)")
  ax.set_title(f"small model, {_BATCH}x{_SEQ} tokens per step, {_DTYPE.value}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  trainer_setup = _trainer_setup()
  has_layer_loop = "layer_loop" in trainer_setup["trainer"].config.model
  setups = {"trainer": trainer_setup, "plain jit": _plain_setup(trainer_setup["trainer"])}
  if has_layer_loop:
    setups["trainer, layer_loop=scan"] = _trainer_setup("scan")
  cpu = {k: [] for k in setups}
  wall = {k: [] for k in setups}
  peaks = []
  for _ in range(_ROUNDS.value):
    for name, s in setups.items():
      c, w = _time_round(s, _STEPS.value)
      cpu[name].append(c)
      wall[name].append(w)
    peaks.append(mfu.measure_host_peak(devices=jax.devices()[:1]).flops_per_cpu_second)

  tokens = _BATCH * _SEQ
  fpt = flops_per_token(trainer_setup["trainer"].model_cfg, _SEQ)
  per_round = lambda a, b: statistics.median(x / y for x, y in zip(cpu[a], cpu[b]))
  rates = {k: tokens / statistics.median(v) for k, v in cpu.items()}
  mfu_rounds = [mfu.mfu(tokens / c, fpt, p) for c, p in zip(cpu["trainer"], peaks)]
  result = {
      "model": "small", "dtype": _DTYPE.value, "tokens_per_step": tokens, "flops_per_token": fpt,
      "jax": jax.__version__, "rounds": _ROUNDS.value, "steps_per_round": _STEPS.value,
      "cpu_seconds_per_step": {k: statistics.median(v) for k, v in cpu.items()},
      "wall_seconds_per_step": {k: statistics.median(v) for k, v in wall.items()},
      "tokens_per_cpu_second": rates,
      "overhead_vs_plain_jit": per_round("trainer", "plain jit"),
      "host_matmul_flops_per_cpu_second": statistics.median(peaks),
      "mfu_small": statistics.median(mfu_rounds),
      "torchft_ratio": None, "maxtext_ratio": None,
      "peers": "not run: torchft and MaxText peers are not wired into this script yet",
      "cpu_seconds_per_round": cpu, "host_peak_per_round": peaks,
  }
  if has_layer_loop:
    result["scan_over_unrolled"] = per_round("trainer, layer_loop=scan", "trainer")
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  _chart(rates, out.with_suffix(".png"))
  print(f"{'setup':<28}{'CPU ms/step':>12}{'wall ms/step':>13}{'tokens/CPU-s':>14}")
  for k in setups:
    print(f"{k:<28}{1e3 * result['cpu_seconds_per_step'][k]:>12.1f}"
          f"{1e3 * result['wall_seconds_per_step'][k]:>13.1f}{rates[k]:>14.0f}")
  print(f"overhead vs plain jit {result['overhead_vs_plain_jit']:.3f}; MFU (CPU-seconds) "
        f"{result['mfu_small']:.3f} of {result['host_matmul_flops_per_cpu_second'] / 1e9:.1f} GFLOP per "
        f"CPU-second; wrote {out}")


if __name__ == "__main__":
  app.run(main)
