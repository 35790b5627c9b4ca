"""Bytes each worker sends per outer synchronization: float32 DiLoCo, 4-bit e3m0, SparseLoCo.

  python benchmarks/sparseloco_bytes.py
  python benchmarks/sparseloco_bytes.py --workers=2,4,8 --chunk_size=4096 --top_k=64 --bits=2

Computed, not measured: from the decoder's parameter shapes (every leaf of the `small` and the
`sdl_*` presets, from ``nnx.eval_shape``, so per-leaf chunking and padding count) and the wire
formats' exact byte counts, under each exchange's traffic model:

- float32 DiLoCo: ring all-reduce, ``2(M−1)/M`` × 4 bytes per parameter (``comm.mean``);
- e3m0: the 4-bit compressed mean, ``2(M−1)`` chunks of ``n / M`` values, 4 bits each plus one
  float32 scale per ``--block_size`` values (``comm.compressed_mean_wire_bytes``);
- SparseLoCo: all-gather of the top-k payload, ``(M−1)`` × payload
  (``comm.sparse_mean_wire_bytes``), at the paper's setting by default.

Writes benchmarks/results/sparseloco_bytes.json with the date.
"""

import datetime
import json
import os
import pathlib
import sys

from absl import app, flags

_WORKERS = flags.DEFINE_list("workers", ["2", "4", "8"], "Numbers of workers M.")
_CHUNK = flags.DEFINE_integer("chunk_size", 4096, "SparseLoCo values per chunk.")
_TOP_K = flags.DEFINE_integer("top_k", 64, "SparseLoCo values kept per chunk.")
_BITS = flags.DEFINE_integer("bits", 2, "SparseLoCo bits per kept value.")
_BLOCK = flags.DEFINE_integer("block_size", 1024, "e3m0 values per scale.")
_PRESETS = flags.DEFINE_list("presets", ["small", "sdl_35m", "sdl_100m", "sdl_200m", "sdl_300m",
                                         "sdl_500m", "sdl_1b", "sdl_4b"], "Model presets.")
_OUT = flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results",
                                               "sparseloco_bytes.json"), "JSON output path.")


def main(argv):
  del argv
  import jax
  from flax import nnx

  from lowcomm_jax import codecs, comm, models
  from lowcomm_jax.models import llama
  from lowcomm_jax.train import workdir

  sparse = codecs.TopKCompressor(_CHUNK.value, _TOP_K.value, _BITS.value)
  e3m0 = codecs.get_codec("e3m0", block_size=_BLOCK.value)
  rows = []
  print(f"{'model':>9} {'params':>13} {'M':>2} {'fp32 DiLoCo':>13} {'e3m0':>12} {'SparseLoCo':>11}"
        f" {'÷ fp32':>7} {'bits/param':>10}")
  for preset in _PRESETS.value:
    cfg = models.get_model_config(preset)
    shapes = nnx.state(nnx.eval_shape(lambda cfg=cfg: llama.Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    leaves = jax.tree.leaves(shapes)
    num_params = sum(leaf.size for leaf in leaves)
    assert num_params == models.param_count(cfg), preset
    payload = comm.sparse_mean_wire_bytes(leaves, sparse)
    for m in map(int, _WORKERS.value):
      dense = comm.ring_factor(m) * 4 * num_params
      quantized = comm.compressed_mean_wire_bytes(leaves, e3m0, m)
      sparse_sent = (m - 1) * payload
      rows.append(dict(model=preset, params=num_params, workers=m, fp32_diloco_bytes=dense,
                       e3m0_bytes=quantized, sparseloco_bytes=sparse_sent,
                       sparseloco_payload_bytes=payload,
                       sparseloco_vs_fp32=dense / sparse_sent,
                       e3m0_vs_fp32=dense / quantized,
                       sparseloco_payload_bits_per_param=8 * payload / num_params))
      print(f"{preset:>9} {num_params:>13,} {m:>2} {dense:>13,.0f} {quantized:>12,} "
            f"{sparse_sent:>11,} {dense / sparse_sent:>6.1f}× {8 * payload / num_params:>10.4f}")
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  result = {"date": date,
            "command": "python benchmarks/sparseloco_bytes.py " + " ".join(sys.argv[1:]),
            "sparseloco": dict(chunk_size=sparse.chunk_size, top_k=sparse.top_k, bits=sparse.bits),
            "e3m0_block_size": _BLOCK.value, "rows": rows}
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  workdir.write_atomic(out, json.dumps(result, indent=1) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
