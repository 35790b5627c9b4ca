"""Codec throughput against a plain copy, and codec error on an outer gradient.

  python benchmarks/codecs.py
  python benchmarks/codecs.py --log2_values=22 --repeats=9 --block_size=256

Throughput: for 2^24 fp32 values, the time of a jitted copy of the array
divided by the time of one jitted ``decode(encode(x))`` (the CPU jnp path,
round to nearest) of each codec, measured in the same run: 1.0 is as fast
as a copy, which reads and writes the array once (the memory-bound limit).
Encode and decode are also timed on their own, since inside one program XLA
may fuse the round trip and never write the codes out. Repetitions are
interleaved (copy, e3m0, e3m0/encode, ... then again) and the median of each
is reported; absolute times are context only.

Error: the relative RMS error ``||decode(encode(Δ)) - Δ|| / ||Δ||`` of each
codec on a real outer gradient from the Trainer
(``lowcomm_jax.train.outer_gradient.diloco_outer_gradient``: Δ = θ_start − θ_end of
replica 0 of a DiLoCo run of the `small` decoder, M = 2, after ``--inner_steps``
inner AdamW steps on the stdlib corpus), at several block sizes, per-tensor
scaling and stochastic rounding. Wire bits per value include the fp32 scales.
Writes benchmarks/results/codecs.json.
"""

import json
import os
import statistics
import time

from absl import app, flags

_LOG2_VALUES = flags.DEFINE_integer("log2_values", 24, "Array size for the throughput test.")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Interleaved repetitions per codec.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 1024, "Block size for the throughput test.")
_INNER_STEPS = flags.DEFINE_integer("inner_steps", 50, "Inner steps of the real outer gradient.")
_OUT = flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results",
                                               "codecs.json"), "JSON output path.")


def _seconds(fn, x):
  start = time.perf_counter()
  jax_block(fn(x))
  return time.perf_counter() - start


def jax_block(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.block_until_ready(tree)


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp

  from lowcomm_jax import codecs
  from lowcomm_jax.codecs import analysis
  from lowcomm_jax.train import outer_gradient

  num_values = 1 << _LOG2_VALUES.value
  x = jax.random.normal(jax.random.key(0), (num_values,), jnp.float32)
  # (program, its input): the round trip, and encode and decode on their own
  # (in the round trip XLA may fuse both and never write the codes out).
  programs = {"copy": (jax.jit(jnp.copy), x)}
  for name in codecs.CODECS:
    codec = codecs.get_codec(name, block_size=_BLOCK_SIZE.value)
    encode = jax.jit(codec.encode)
    programs[name] = (jax.jit(codec.roundtrip), x)
    programs[name + "/encode"] = (encode, x)
    programs[name + "/decode"] = (jax.jit(codec.decode), jax_block(encode(x)))
  for fn, arg in programs.values():  # compile and warm up
    _seconds(fn, arg)
  times = {name: [] for name in programs}
  for _ in range(_REPEATS.value):
    for name, (fn, arg) in programs.items():
      times[name].append(_seconds(fn, arg))
  median = {name: statistics.median(ts) for name, ts in times.items()}
  gigabytes = 2 * 4 * num_values / 1e9  # copy: read + write of fp32
  print(f"{jax.devices()[0].platform} jnp path, 2^{_LOG2_VALUES.value} fp32 values, block "
        f"{_BLOCK_SIZE.value}, median of {_REPEATS.value} interleaved runs; "
        f"copy {1e3 * median['copy']:.1f} ms ({gigabytes / median['copy']:.1f} GB/s read+write)")
  print(f"{'codec':<6} {'round trip ms':>14} {'throughput / copy':>18} "
        f"{'encode / copy':>14} {'decode / copy':>14}")
  throughput = []
  for name in codecs.CODECS:
    row = dict(codec=name, roundtrip_s=median[name],
               throughput_over_copy=median["copy"] / median[name],
               encode_s=median[name + "/encode"], decode_s=median[name + "/decode"],
               encode_throughput_over_copy=median["copy"] / median[name + "/encode"],
               decode_throughput_over_copy=median["copy"] / median[name + "/decode"])
    throughput.append(row)
    print(
      f"{name:<6} {1e3 * median[name]:>14.2f} {row['throughput_over_copy']:>18.3f} "
      f"{row['encode_throughput_over_copy']:>14.3f} {row['decode_throughput_over_copy']:>14.3f}"
    )

  delta, info = outer_gradient.diloco_outer_gradient("small", 2, _INNER_STEPS.value)
  source = (
    f"real: DiLoCo small decoder, M=2, replica 0 after {_INNER_STEPS.value} inner AdamW steps"
  )
  num_params = sum(int(v.size) for v in jax.tree.leaves(delta))
  rows = analysis.error_table(delta, key=jax.random.key(1))
  print(f"\nrelative RMS error on an outer gradient ({num_params} values; {source})")
  columns = list(rows[0]["relative_rms"])
  print(f"{'codec':<6} {'bits/value @1024':>16} " + " ".join(f"{c:>18}" for c in columns))
  for row in rows:
    print(f"{row['codec']:<6} {row['bits_per_value']['1024']:>16.3f} "
          + " ".join(f"{row['relative_rms'][c]:>18.4f}" for c in columns))

  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(dict(platform=jax.devices()[0].platform, num_values=num_values,
                   copy_s=median["copy"],
                   block_size=_BLOCK_SIZE.value, repeats=_REPEATS.value, throughput=throughput,
                   outer_gradient=dict(source=source,
                                       num_values=num_params, **info),
                   error=rows), f, indent=1)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
