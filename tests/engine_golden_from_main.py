"""How tests/test_engine.py's GOLDEN values were produced, once, from main before the one-engine
redesign.

  mkdir /tmp/main12b1c45 && git archive 12b1c45 | tar -x -C /tmp/main12b1c45
  # writes /tmp/engine/golden.json:
  PYTHONPATH=/tmp/main12b1c45 python tests/engine_golden_from_main.py

Runs the configs of lowcomm_jax.testing.ENGINE_CASES with the code of that commit: its Trainer for
dp, diloco, streaming_diloco and noloco; its own pipeline loop (parallel/combined.py, since removed)
for pipeline_noloco and pipeline_diloco; skippipe/training.py's make_path_train_step for skippipe.
Not collected by pytest (not a test file); kept so the numbers can be reproduced. Its config keys
are that commit's (`diloco.*`, which `lowcomm_jax.config.MOVED_KEYS` maps to `outer.*` today).
"""
import json
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import numpy as np
import optax

from lowcomm_jax import config as config_lib
from lowcomm_jax.train import Trainer


def base(**ch):
  c = config_lib.default_config()
  config_lib.override(c,
                      {"model.size": "tiny", "num_steps": 6, "data.seq_len": 32,
                       "data.batch_size": 4,
    "eval.batch_size": 4, "eval.num_batches": 2, "eval.every": 3, "checkpoint.every": 2,
                          "log_every": 1,
    "progress_bar": False, "hardware.peak_flops_per_device": 1e10, "optimizer.warmup_steps": 2,
    "mesh.data": 1})
  return config_lib.override(c, ch)

CASES = {
  "dp": {},
  "diloco": {"algorithm": "diloco", "num_replicas": 2, "diloco.sync_every": 3},
  "streaming_diloco": {"algorithm": "streaming_diloco", "num_replicas": 2,
                       "diloco.num_fragments": 2,
      "diloco.non_block_fragment": "fold", "diloco.sync_every": 4, "diloco.overlap_steps": 1,
      "diloco.merge_alpha": 0.5},
  "noloco": {"algorithm": "noloco", "num_replicas": 4, "noloco.sync_every": 3,
             "noloco.num_groupings": 2},
}
out = {}
for name, ch in CASES.items():
  d = tempfile.mkdtemp()
  Trainer(base(**ch), d, devices=jax.devices()[:1]).run()
  rows = [json.loads(l) for l in open(d + "/metrics.jsonl")]
  out[name] = {r["step"]: (r["loss"], r["grad_norm"]) for r in rows}

# Pipeline (parallel/combined.py's loop), NoLoCo and DiLoCo, random routing.
from lowcomm_jax.parallel import combined, stages
from lowcomm_jax.parallel.executor import PipelineExecutor

for alg in ("noloco", "diloco"):
  c = combined.default_config()
  c.algorithm = alg; c.num_stages = 2; c.num_replicas = 2; c.num_steps = 6
  c.data.seq_len = 32
  c.data.microbatch_size = 2
  c.pipeline.slots_per_step = 2
  c.pipeline.num_routings = 2
  c.optimizer.warmup_steps = 2; c.noloco.sync_every = 3; c.noloco.num_groupings = 2
  c.diloco.sync_every = 3; c.eval.every = 3; c.eval.batch_size = 4; c.eval.num_batches = 2
  norms = []
  orig = PipelineExecutor.__call__
  def call(self, grid, batch, orig=orig):
    r = orig(self, grid, batch)
    g = stages.from_grid(r.grads)
    norms.append(
      float(np.mean([optax.tree.norm(jax.tree.map(lambda x, i=i: x[i], g)) for i in range(2)]))
    )
    return r
  PipelineExecutor.__call__ = call
  res = combined.train(c, log=lambda s: None)
  PipelineExecutor.__call__ = orig
  out["pipeline_" + alg] = {m["step"]: (m["loss"], norms[m["step"] - 1]) for m in res.metrics}

# SkipPipe path training (skippipe/training.py), 4 stages of 1 layer, explicit paths.
from lowcomm_jax.data import pipeline
from lowcomm_jax.models import get_model_config
from lowcomm_jax.skippipe import training
from lowcomm_jax.train import step as step_lib

c = base()
cfg = get_model_config("tiny", num_layers=4)
tx = step_lib.make_optimizer(c.optimizer, 6)
graphdef, state = training.init_state(cfg, tx, 0)
step = training.make_path_train_step(graphdef, tx, 4, 1)
paths = np.array([[0, 1, 2], [0, 2, 3], [0, 3, 1], [0, 1, 3]])
splits = pipeline.load_splits("stdlib", 20)
data = pipeline.train_dataset(splits.train, 32, 4, 0)
rows = {}
for i in range(6):
  state, m = step(state, np.asarray(data[i]).reshape(4, 1, 33), paths)
  rows[i + 1] = (float(m["loss"]), float(m["grad_norm"]))
out["skippipe"] = rows
import pathlib as _p

_p.Path("/tmp/engine").mkdir(exist_ok=True)
json.dump(out, open("/tmp/engine/golden.json", "w"), indent=1)
