"""Evaluation of a run's checkpoint on any configured data: loss per token and bits per byte.

The parameters are what the run evaluates (`checkpoint.read_eval_params`: DiLoCo's global φ,
NoLoCo's mean slow weights). The data section (`data.corpus`, `data.eval_permille`, `data.seq_len`,
the document cuts) and `eval.batch_size`/`eval.num_batches` may be changed from the run's; the
tokenizer (the run's copy in its workdir) and the model may not, since the parameters are tied to
them. The workdir is only read.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Sequence

import numpy as np
from flax import nnx

from lowcomm_jax import config as config_lib
from lowcomm_jax.data import pipeline
from lowcomm_jax.models import llama, loss as loss_lib
from lowcomm_jax.train import checkpoint, run_inputs, validation

CHANGEABLE = ("data.corpus", "data.eval_permille", "data.seq_len", "data.doc_separator",
              "data.doc_chars", "eval.batch_size", "eval.num_batches")


def run_config(workdir, changes: dict | None = None):
  """The run's config with `changes` (dotted keys of CHANGEABLE) applied, checked before any
  compute; one ValueError naming the option otherwise."""
  workdir = pathlib.Path(workdir)
  if not (workdir / "config.json").is_file():
    raise ValueError(f"--workdir={workdir} holds no config.json: not a run directory")
  checkpoints = workdir / "checkpoints"
  if not checkpoints.is_dir() or not any(checkpoints.iterdir()):
    raise ValueError(f"--workdir={workdir} holds no checkpoint to evaluate")
  c = run_inputs.run_config(workdir)  # the tokenizer: the run's copy
  max_len = config_lib.model_config_of(c).max_seq_len  # the model's, before data.seq_len changes
  for key, value in (changes or {}).items():
    if key not in CHANGEABLE:
      raise ValueError(f"--config.{key} cannot change for an evaluation; allowed: "
                       f"{', '.join('--config.' + k for k in CHANGEABLE)}")
    section, name = key.split(".")
    old = c[section][name]
    try:
      c[section][name] = type(old)(value)  # from the command line: a string
    except ValueError:
      raise ValueError(f"--config.{key}={value!r} must be of type {type(old).__name__}") from None
  c = validation.validate(c)
  if c.data.seq_len > max_len:
    raise ValueError(f"--config.data.seq_len={c.data.seq_len}: the model's rotary table holds "
                     f"{max_len} positions; data.seq_len must be <= {max_len}")
  return c


def evaluate(workdir, changes: dict | None = None) -> dict:
  """{"eval_loss" (nats per token), "eval_bits_per_byte", "eval_tokens", ...} of the run's latest
  checkpoint on the (changed) data."""
  return evaluate_corpora(workdir, [], changes)[0]


def evaluate_corpora(workdir, corpora: Sequence[str], changes: dict | None = None) -> list[dict]:
  """`evaluate` on each of `corpora` in turn (the run's own `data.corpus` when empty), the
  checkpoint read once: e.g. an HDEE expert's run on every `domain:<d>`. All are checked before
  any compute."""
  configs = [run_config(workdir, {**(changes or {}), **({"data.corpus": corpus} if corpus else {})})
             for corpus in (list(corpora) or [""])]
  for c in configs:  # the run's own data changed since: said in one line, scored as it is
    note = run_inputs.data_note(workdir, c)
    if note:
      print(note, file=sys.stderr, flush=True)
  model_cfg, params = checkpoint.read_eval_params(workdir)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: llama.Decoder(model_cfg, nnx.Rngs(0))), nnx.Param)
  loss_fn = loss_lib.jitted_loss(graphdef)
  results = []
  for c in configs:
    splits = pipeline.splits_of(c)
    batches = pipeline.eval_batches(splits.eval, c.data.seq_len, c.eval.batch_size,
                                    c.eval.num_batches)
    loss = float(np.mean([float(loss_fn(params, b)) for b in batches]))
    results.append({"workdir": str(workdir), "corpus": c.data.corpus, "tokenizer": c.data.tokenizer,
                    "eval_loss": loss, "eval_bits_per_byte": splits.bits_per_byte(loss),
                    "eval_bytes_per_token": splits.bytes_per_token,
                    "eval_tokens": int(batches.shape[0] * batches.shape[1] * c.data.seq_len)})
  return results
