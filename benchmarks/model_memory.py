"""Temporaries of the model's gradient program per preset × attention × remat, from XLA's buffer
assignment.

    python benchmarks/model_memory.py [--presets=sdl_35m,sdl_1b] [--attentions=xla] [--remats=dots]
        [--batch=8] [--seq_len=2048]

Rows of earlier runs in the result file are kept unless measured again (same model, attention,
remat, batch and sequence length).

For each row, `jax.jit(value_and_grad(loss))` of one replica's decoder (the preset's dtype,
`layer_loop=scan` as on accelerators) is traced with abstract shapes (nothing is allocated) and
compiled for the host CPU; `compiled.memory_analysis()` gives the bytes of its temporaries (the
activations kept for the backward and the backward's working buffers), its arguments (float32
parameters and the tokens) and its outputs (the loss and float32 gradients). A cross-platform
lowering for cuda gives no buffer assignment (that needs the CUDA compiler, i.e. a GPU host), so
the cuda column stays empty here. On CPU `attention=dot_product` runs jax's XLA implementation;
cuDNN's fused kernel, which keeps no [B, H, T, T] tensor, exists only on a GPU.

Writes benchmarks/results/model_memory.json (rows and the date) and prints a table.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx  # pylint: disable=g-import-not-at-top,wrong-import-position

from lowcomm_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from lowcomm_jax.models import config as model_config, llama  # pylint: disable=wrong-import-position

_PRESETS = flags.DEFINE_list("presets",
                             ["sdl_35m", "sdl_100m", "sdl_200m", "sdl_300m", "sdl_500m", "sdl_1b",
                              "sdl_4b"],
                             "model presets to measure")
_ATTENTIONS = flags.DEFINE_list("attentions", ["xla", "dot_product"], "model.attention values")
_REMATS = flags.DEFINE_list("remats", list(model_config.REMATS), "model.remat values")
_BATCH = flags.DEFINE_integer("batch", 8, "sequences per replica")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 2048, "tokens per sequence")
_OUT = flags.DEFINE_string("out",
                           str(pathlib.Path(__file__).parent / "results" / "model_memory.json"),
                           "result file")


def gradient_program(cfg: models.ModelConfig, batch: int, seq_len: int):
  """jit(value_and_grad(mean cross-entropy)) of the decoder, traced for abstract shapes."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: llama.Decoder(cfg, nnx.Rngs(0))))
  params = jax.eval_shape(lambda: llama.init_params(cfg, 0))

  def loss(params, tokens_BxT):
    logits = nnx.merge(graphdef, params)(tokens_BxT[:, :-1])
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens_BxT[:, 1:, None], axis=-1))
  return jax.jit(jax.value_and_grad(loss)).trace(params,
                                                 jax.ShapeDtypeStruct((batch, seq_len + 1),
                                                                      jnp.int32))


def measure(name: str, attention: str, remat: str, batch: int, seq_len: int) -> dict:
  cfg = dataclasses.replace(models.PRESETS[name], attention=attention, remat=remat,
                            layer_loop="scan",
                            max_seq_len=max(seq_len, models.PRESETS[name].max_seq_len))
  start = time.perf_counter()
  analysis = gradient_program(cfg, batch, seq_len).lower().compile().memory_analysis()
  return {"model": name, "parameters": models.param_count(cfg), "dtype": cfg.dtype,
          "attention": attention,
          "remat": remat, "batch": batch, "seq_len": seq_len,
          "cpu_temp_bytes": analysis.temp_size_in_bytes,
          "cpu_argument_bytes": analysis.argument_size_in_bytes,
          "cpu_output_bytes": analysis.output_size_in_bytes, "cuda_temp_bytes": None,
          "compile_s": round(time.perf_counter() - start, 1)}


def main(argv):
  del argv
  rows = []
  print(f"{'model':>9} {'attention':>11} {'remat':>5} {'temp GB':>8} {'args GB':>8} {'out GB':>7}")
  for name in _PRESETS.value:
    for attention in _ATTENTIONS.value:
      for remat in _REMATS.value:
        row = measure(name, attention, remat, _BATCH.value, _SEQ_LEN.value)
        rows.append(row)
        print(f"{name:>9} {attention:>11} {remat:>5} {row['cpu_temp_bytes'] / 1e9:8.2f} "
              f"{row['cpu_argument_bytes'] / 1e9:8.2f} {row['cpu_output_bytes'] / 1e9:7.2f}",
              flush=True)
  out = pathlib.Path(_OUT.value)
  key = lambda row: (row["model"], row["attention"], row["remat"], row["batch"], row["seq_len"])
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  command = "python benchmarks/model_memory.py " + " ".join(sys.argv[1:])
  for row in rows:
    row.update(date=date, command=command, jax=jax.__version__)
  measured = {key(row) for row in rows}
  earlier = json.loads(out.read_text())["rows"] if out.exists() else []
  rows = [row for row in earlier if key(row) not in measured] + rows
  result = {"date": date,
            "cuda": "not measured: a cross-platform lowering has no buffer assignment "
            "(needs a GPU host)", "rows": rows}
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_suffix(".tmp")
  tmp.write_text(json.dumps(result, indent=1) + "\n")
  os.replace(tmp, out)
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
