"""Shared helpers for the tests (and for users testing their own configs): tiny run configs, the
engine battery's cases, run outputs, HLO collective bytes. No test file imports another test file.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

import ml_collections

from lowcomm_jax import config as config_lib

# -- run configs and outputs (the engine battery, tests/test_engine.py) ---------------------------


def tiny_config(**changes) -> ml_collections.ConfigDict:
  """The `tiny` model on 8 × 64 bytes per step, 40 steps, logging every step, no bar."""
  c = config_lib.default_config()
  config_lib.override(c, {
      "model.size": "tiny", "num_steps": 40, "data.seq_len": 64, "data.batch_size": 8,
      "eval.batch_size": 8, "eval.num_batches": 4, "eval.every": 1000, "checkpoint.every": 1000,
      "log_every": 1, "progress_bar": False, "hardware.peak_flops_per_device": 1e10})
  return config_lib.override(c, changes)


def engine_config(case: str, **changes) -> ml_collections.ConfigDict:
  """A 6-step run of battery case `case` (ENGINE_CASES) on 32-byte windows, 4 per replica."""
  base = {"num_steps": 6, "data.seq_len": 32, "data.batch_size": 4, "eval.batch_size": 4,
          "eval.num_batches": 2, "eval.every": 3, "checkpoint.every": 2, "optimizer.warmup_steps": 2,
          "mesh.data": 1}
  return tiny_config(**{**base, **ENGINE_CASES[case]["config"], **changes})


_PIPELINE = {"gradients": "pipeline", "num_replicas": 2, "mesh.replica": 2, "mesh.stage": 2,
             "pipeline.num_routings": 2, "optimizer.name": "adam", "optimizer.grad_clip": 0.0}

# Every algorithm and gradient source the one Trainer runs. "sync": the first step with an outer
# step (its metrics are computed before it; the step after shows its effect).
ENGINE_CASES = {
    "dp": {"config": {}, "sync": 1},
    "diloco": {"config": {"algorithm": "diloco", "num_replicas": 2, "diloco.sync_every": 3}, "sync": 3},
    "streaming_diloco": {"config": {
        "algorithm": "streaming_diloco", "num_replicas": 2, "diloco.num_fragments": 2,
        "diloco.non_block_fragment": "fold", "diloco.sync_every": 4, "diloco.overlap_steps": 1,
        "diloco.merge_alpha": 0.5}, "sync": 3},
    "noloco": {"config": {"algorithm": "noloco", "num_replicas": 4, "noloco.sync_every": 3,
                          "noloco.num_groupings": 2}, "sync": 3},
    "skippipe": {"config": {"gradients": "skippipe", "pipeline.num_stages": 4,
                            "skippipe.paths": "0-1-2,0-2-3,0-3-1,0-1-3"}, "sync": 1},
    "pipeline_noloco": {"config": {**_PIPELINE, "algorithm": "noloco", "noloco.sync_every": 3,
                                   "noloco.num_groupings": 2}, "sync": 3},
    "pipeline_diloco": {"config": {**_PIPELINE, "algorithm": "diloco", "diloco.sync_every": 3,
                                   "outer_optimizer.momentum": 0.3}, "sync": 3},
}


def read_metrics(workdir) -> list[dict]:
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def tree_digest(directory) -> dict:
  """{relative path: sha256} of every file under `directory` (to prove it was left untouched)."""
  directory = pathlib.Path(directory)
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1,
                "f64": 8, "s64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


def collective_bytes(line: str) -> int:
  """Bytes of a collective's result in one HLO instruction line (all its tuple elements)."""
  result = line.split("=", 1)[1].split("(", 1)[0] if "= (" not in line else line.split("= (", 1)[1].split(")", 1)[0]
  total = 0
  for dtype, dims in _SHAPE.findall(result):
    size = 1
    for d in filter(None, dims.split(",")):
      size *= int(d)
    total += size * _DTYPE_BYTES[dtype]
  return total
