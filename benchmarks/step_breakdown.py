"""Where our step's CPU time goes against torch's, one replica on one core, attention ablated or
not.

  nice -n 10 python benchmarks/step_breakdown.py [--rounds=5 --steps=10]
      [--torchft_python=/work/peers/torchft-venv/bin/python]

step_speed.py compares whole DiLoCo steps (our two replica devices in one process against
torchft's two single-threaded replica processes). This benchmark takes the two sides apart: one
replica's inner step (the `small` model, 8 × 128 tokens, float32, AdamW after a global-norm clip),
everything pinned to one core (so XLA's thread pool has one thread, as each torchft replica has),
and each side once more with attention replaced by the mean of q, k and v (projections, rotary and
everything else kept). Setups, timed in interleaved rounds (process CPU-seconds per step; medians):
- `ours`: the Trainer's compiled step on one CPU device;
- `ours, no attention`: the same with `llama.causal_attention` replaced while the step is traced;
- `ours, attention=cpu_kernel`: `ours` with model.attention="cpu_kernel" (the fused C++ kernel,
  cpu_kernels/attention.py), whose attention cost is likewise its difference to the ablated step;
- `torch` and `torch, no attention`: benchmarks/peers/torch_step.py in the torchft venv.
Attention's cost in a step is the difference of a side's two setups (median of per-round
differences); `rest` is the step without attention. Writes benchmarks/results/step_breakdown.json.
"""

import os

# One core for this process and the peers it starts (they inherit it): XLA sizes its CPU thread
# pool from this affinity when it creates the CPU client, so it comes first, before any JAX work.
os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import pathlib  # pylint: disable=g-import-not-at-top,wrong-import-position
import statistics  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position

import step_speed  # pylint: disable=g-import-not-at-top,wrong-import-position
from lowcomm_jax.models import llama  # pylint: disable=g-import-not-at-top,wrong-import-position

# step_speed's flags serve here too (rounds, steps, dtype, torchft_python, out), with own defaults.
flags.FLAGS.set_default("out",
                        str(pathlib.Path(__file__).parent / "results" / "step_breakdown.json"))
flags.FLAGS.set_default("rounds", 5)
flags.FLAGS.set_default("steps", 10)
_BATCH = 8  # sequences of one replica's inner step, as in step_speed's DiLoCo comparison


def _no_attention(q, k, v):
  return (q + k + v) / 3


def _ours(ablate: bool, attention=None):
  config = step_speed._config(None, attention)  # pylint: disable=protected-access
  config.data.batch_size = _BATCH
  original = llama.causal_attention
  if ablate:  # Attention.__call__ looks the function up when the step is traced (here)
    llama.causal_attention = _no_attention
  try:
    return step_speed._trainer_setup(config=config)  # pylint: disable=protected-access
  finally:
    llama.causal_attention = original


def _torch(model_cfg, ablate: bool):
  m = model_cfg
  args = [f"--vocab_size={m.vocab_size}", f"--d_model={m.d_model}", f"--num_layers={m.num_layers}",
          f"--num_heads={m.num_heads}", f"--d_ff={m.d_ff}", f"--seq_len={step_speed._SEQ}",  # pylint: disable=protected-access
          f"--batch={_BATCH}", "--threads=1"] + (["--no_attention"] if ablate else [])
  return step_speed.Peer("torch" + (", no attention" if ablate else ""),
                         step_speed._TORCHFT_PYTHON.value, "torch_step.py", args)  # pylint: disable=protected-access


def main(argv):
  del argv
  steps = step_speed._STEPS.value  # pylint: disable=protected-access
  ours = {"ours": _ours(False), "ours, no attention": _ours(True)}
  kernel = step_speed._KERNEL  # pylint: disable=protected-access
  if kernel:
    ours["ours" + kernel] = _ours(False, "cpu_kernel")
  model_cfg = ours["ours"]["trainer"].model_cfg
  peers = {"torch": _torch(model_cfg, False), "torch, no attention": _torch(model_cfg, True)}
  for name, peer in peers.items():
    if peer.skipped:
      raise SystemExit(f"{name}: {peer.skipped}")
  cpu = {k: [] for k in list(ours) + list(peers)}
  try:
    for r in range(-1, step_speed._ROUNDS.value):  # pylint: disable=protected-access
      timed = {k: step_speed._time_round(s, steps)[0] for k, s in ours.items()}  # pylint: disable=protected-access
      timed.update({k: p.run(steps)[0] for k, p in peers.items()})
      print(f"round {r + 1}: " + ", ".join(f"{k} {1e3 * c:.1f}" for k, c in timed.items())
            + " CPU-ms per step", flush=True)
      if r >= 0:  # round 0 warms up
        for k, c in timed.items():
          cpu[k].append(c)
  finally:
    for peer in peers.values():
      peer.close()

  ms = lambda xs: 1e3 * statistics.median(xs)
  diff = lambda a, b: [x - y for x, y in zip(cpu[a], cpu[b])]
  ratio = lambda a, b: statistics.median(x / y for x, y in zip(cpu[a], cpu[b]))
  result = {
    "model": "small",
    "tokens_per_step": _BATCH * step_speed._SEQ,
    "dtype": step_speed._DTYPE.value,  # pylint: disable=protected-access
    "cores": 1,
    "jax": jax.__version__,
    "torch": peers["torch"].ready["torch"],
    "rounds": step_speed._ROUNDS.value,
    "steps_per_round": steps,  # pylint: disable=protected-access
    "cpu_ms_per_step": {k: ms(v) for k, v in cpu.items()},
    "attention_ms_per_step": {
      "ours": ms(diff("ours", "ours, no attention")),
      "torch": ms(diff("torch", "torch, no attention")),
    },
    "ours_over_torch": {
      "step": ratio("ours", "torch"),
      "without_attention": ratio("ours, no attention", "torch, no attention"),
    },
  }
  if kernel:
    result["attention_ms_per_step"]["ours" + kernel] = ms(diff("ours" + kernel,
                                                               "ours, no attention"))
    result["ours_over_torch"]["step" + kernel] = ratio("ours" + kernel, "torch")
  result["cpu_seconds_per_round"] = cpu
  result["attention_share_ours"] = (
    result["attention_ms_per_step"]["ours"] / result["cpu_ms_per_step"]["ours"]
  )
  out = pathlib.Path(step_speed._OUT.value)  # pylint: disable=protected-access
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  for k, v in result["cpu_ms_per_step"].items():
    print(f"{k:<22}{v:8.1f} CPU-ms per step")
  print(f"attention: ours {result['attention_ms_per_step']['ours']:.1f} ms, torch "
        f"{result['attention_ms_per_step']['torch']:.1f} ms; ours / torch: step "
        f"{result['ours_over_torch']['step']:.3f}, without attention "
        f"{result['ours_over_torch']['without_attention']:.3f}; wrote {out}")


if __name__ == "__main__":
  app.run(main)
