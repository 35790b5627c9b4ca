"""The fused CPU attention kernel alone against XLA's attention, one layer's shape of `small`, one
core.

  nice -n 10 python benchmarks/attention_kernel.py [--rounds=5 --calls=200]

Times, in interleaved rounds (process CPU-seconds per call, medians), the forward and the backward
of `cpu_kernels/attention.py` (q, k, v [8, 128, 4, 32], float32) and the same two of
`llama.causal_attention` (the default `model.attention="xla"`, on the [8, 4, 128, 32] transposes),
each jitted alone, and the kernel's FLOP rate over the FLOPs it executes (the score and output
products of its 4-row blocks up to the diagonal, tile-rounded). Writes
benchmarks/results/attention_kernel.json.
"""

import os

# One core, as step_breakdown.py: XLA's thread pool then has one thread.
os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import pathlib  # pylint: disable=g-import-not-at-top,wrong-import-position
import statistics  # pylint: disable=g-import-not-at-top,wrong-import-position
import time  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position

from lowcomm_jax.cpu_kernels import attention as cpu_attention
from lowcomm_jax.models import llama  # pylint: disable=g-import-not-at-top,wrong-import-position

_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timed rounds (after one warm-up round).")
_CALLS = flags.DEFINE_integer("calls", 200, "Calls per setup per round.")
_OUT = flags.DEFINE_string("out",
                           str(pathlib.Path(__file__).parent / "results" / "attention_kernel.json"),
                           "Where to write the results.")
_B, _T, _H, _K = 8, 128, 4, 32  # one layer of `small` at 8 × 128 tokens (step_breakdown's replica)
# the kernel's query-row block and score-column tile (cpu_kernels/attention.cc)
_ROWS, _TILE = 4, 16


def _executed_flops() -> tuple[int, int]:
  """(forward, backward) FLOPs the kernel executes: per block of 4 query rows ending at row n, the
  score products over ceil(n / 16)·16 key columns and the output products over n keys."""
  scores = sum(_ROWS * -(-(i0 + _ROWS) // _TILE) * _TILE for i0 in range(0, _T, _ROWS))
  outputs = sum(_ROWS * (i0 + _ROWS) for i0 in range(0, _T, _ROWS))
  per_slice = lambda products: 2 * _K * products * _B * _H
  # forward: S, O; backward: S again, dP (score-shaped), dQ, dK, dV (output-shaped)
  return per_slice(scores + outputs), per_slice(2 * scores + 3 * outputs)


def _setups():
  cpu_attention.load()
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, d_out = (jax.random.normal(key, (_B, _T, _H, _K)) for key in keys)
  bhtk = lambda x: jnp.swapaxes(x, 1, 2)
  kernel_fwd = jax.jit(lambda q, k, v: cpu_attention._ffi(cpu_attention._FORWARD, q, k, v))  # pylint: disable=protected-access
  out, lse = kernel_fwd(q, k, v)
  kernel_bwd = jax.jit(lambda *a: cpu_attention._ffi(cpu_attention._BACKWARD, *a))  # pylint: disable=protected-access
  xq, xk, xv, xd = map(bhtk, (q, k, v, d_out))
  xla_fwd = jax.jit(llama.causal_attention)
  xla_vjp = jax.jit(lambda q, k, v, d: jax.vjp(llama.causal_attention, q, k, v)[1](d))
  return {
      "kernel forward": lambda: kernel_fwd(q, k, v),
      "kernel backward": lambda: kernel_bwd(q, k, v, out, lse, d_out),
      "xla forward": lambda: xla_fwd(xq, xk, xv),
      # the forward again plus the backward: XLA's backward needs the forward's residuals
      "xla forward + backward": lambda: xla_vjp(xq, xk, xv, xd),
  }


def _time(call, n):
  jax.block_until_ready(call())
  start = time.process_time()
  for _ in range(n):
    jax.block_until_ready(call())
  return (time.process_time() - start) / n


def main(argv):
  del argv
  setups = _setups()
  cpu = {name: [] for name in setups}
  for r in range(-1, _ROUNDS.value):  # round -1 warms up
    timed = {name: _time(call, _CALLS.value) for name, call in setups.items()}
    print(
      f"round {r + 1}: " + ", ".join(f"{k} {1e3 * c:.3f}" for k, c in timed.items()) + " CPU-ms"
    )
    if r >= 0:
      for name, c in timed.items():
        cpu[name].append(c)
  ms = {name: 1e3 * statistics.median(v) for name, v in cpu.items()}
  fwd_flops, bwd_flops = _executed_flops()
  result = {
      "shape_bthk": [_B, _T, _H, _K], "dtype": "float32", "cores": 1, "jax": jax.__version__,
      "rounds": _ROUNDS.value, "calls_per_round": _CALLS.value, "cpu_ms_per_call": ms,
      "kernel_gflop_per_cpu_second": {"forward": fwd_flops / ms["kernel forward"] / 1e6,
                                      "backward": bwd_flops / ms["kernel backward"] / 1e6},
      "kernel_over_xla_forward_and_backward": statistics.median(
          (f + b) / x for f, b, x in zip(cpu["kernel forward"], cpu["kernel backward"],
                                         cpu["xla forward + backward"])),
      "cpu_seconds_per_round": cpu,
  }
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print(json.dumps({k: result[k] for k in ("cpu_ms_per_call", "kernel_gflop_per_cpu_second",
                                           "kernel_over_xla_forward_and_backward")}, indent=1))


if __name__ == "__main__":
  app.run(main)
