"""The Trainer: validated config in, a run directory out.

Outputs in the workdir: config.json, metrics.jsonl, tensorboard/, checkpoints/
(orbax; train state + data iterator state) and summary.json. Restarting with
the same workdir and config resumes from the latest checkpoint and ends
bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lowcomm_jax import config as config_lib
from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax import sharding
from lowcomm_jax.data import pipeline
from lowcomm_jax.models import config as model_config
from lowcomm_jax.models import llama
from lowcomm_jax.train import checkpoint, metrics as metrics_lib, step as step_lib


def measure_peak_flops(device=None, size: int = 1024, seconds: float = 0.3) -> float:
  """FLOP/s of a float32 matmul on one device: the reference peak for MFU on a CPU."""
  device = device or jax.devices()[0]
  a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  count, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    matmul(a).block_until_ready()
    count += 1
  return 2 * size**3 * count / (time.perf_counter() - start)


class Trainer:
  """Data-parallel training of the configured model on the configured corpus.

  Every check on the config, the mesh and the workdir happens in the
  constructor, before any compute and before anything is written.
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | pathlib.Path, devices=None):
    config_lib.validate(config)
    self.config = config
    self.workdir = pathlib.Path(workdir)
    self.mesh = mesh_lib.make_mesh(config.mesh.to_dict(), devices)
    data_ways = self.mesh.shape[mesh_lib.DATA]
    if config.data.batch_size % data_ways:
      raise ValueError(f"data.batch_size={config.data.batch_size} is not divisible by the mesh's "
                       f"data axis ({data_ways}); choose a multiple of {data_ways} or change mesh.data")
    if config.eval.batch_size % data_ways:
      raise ValueError(f"eval.batch_size={config.eval.batch_size} is not divisible by the mesh's "
                       f"data axis ({data_ways})")
    self.model_cfg = model_config.get_model_config(
        config.model.size, dtype=config.model.dtype,
        max_seq_len=max(model_config.PRESETS[config.model.size].max_seq_len, config.data.seq_len))
    self.rules = sharding.rules_for(config.sharding.layout)
    self.resuming = checkpoint.check_workdir(self.workdir, config_lib.fingerprint(config))
    abstract_model = nnx.eval_shape(lambda: llama.Decoder(self.model_cfg, nnx.Rngs(config.seed)))
    self.graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    abstract_params = abstract_params.to_pure_dict()
    self.axes = llama.logical_axes(abstract_model)
    self.param_specs = sharding.param_specs(self.axes, abstract_params, self.rules, self.mesh)
    self.param_shardings = sharding.named(self.mesh, self.param_specs)
    self.num_params = model_config.param_count(self.model_cfg)

  # -- building blocks, also used by tests -------------------------------------------------------

  def init_params(self):
    cfg, seed = self.model_cfg, self.config.seed
    init = lambda: nnx.state(llama.Decoder(cfg, nnx.Rngs(seed)), nnx.Param).to_pure_dict()
    return jax.jit(init, out_shardings=self.param_shardings)()

  def init_state(self, tx) -> step_lib.TrainState:
    params = self.init_params()
    # Moments inherit the parameters' shardings; scalars (counts) are replicated over the mesh.
    opt_state = jax.tree.map(self._on_mesh, jax.jit(tx.init)(params))
    return step_lib.TrainState(params, opt_state, self._on_mesh(jnp.zeros((), jnp.int32)))

  def _on_mesh(self, x):
    if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self.mesh:
      return x
    return jax.device_put(x, NamedSharding(self.mesh, P()))

  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(mesh_lib.DATA, None))

  def compile_steps(self, tx, state):
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    train_step = jax.jit(step_lib.make_train_step(self.graphdef, tx),
                         in_shardings=(state_shardings, self.batch_sharding()),
                         out_shardings=(state_shardings, None), donate_argnums=0)
    eval_step = jax.jit(step_lib.make_eval_step(self.graphdef),
                        in_shardings=(state_shardings.params, self.batch_sharding()))
    return train_step, eval_step

  def evaluate(self, eval_step, params, eval_batches: np.ndarray) -> float:
    losses = [eval_step(params, b) for b in eval_batches]
    return float(np.mean(jax.device_get(losses)))

  # -- the run -----------------------------------------------------------------------------------

  def run(self) -> dict:
    c = self.config
    self.workdir.mkdir(parents=True, exist_ok=True)
    if not self.resuming:
      (self.workdir / "config.json").write_text(json.dumps(
          {"config": json.loads(c.to_json_best_effort()),
           "fingerprint": config_lib.fingerprint(c)}, indent=1, default=str))
    splits = pipeline.load_splits(c.data.corpus, c.data.eval_permille)
    train_ds = pipeline.train_dataset(splits.train, c.data.seq_len, c.data.batch_size, c.seed)
    eval_batches = pipeline.eval_batches(splits.eval, c.data.seq_len, c.eval.batch_size,
                                         c.eval.num_batches)
    tx = step_lib.make_optimizer(c.optimizer, c.num_steps)
    state = self.init_state(tx)
    train_step, eval_step = self.compile_steps(tx, state)

    ckpt = checkpoint.Checkpointer(self.workdir, c.checkpoint.keep)
    data_iter = iter(train_ds)
    start = ckpt.latest_step() or 0
    if start:
      state, data_state = ckpt.restore(start, jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
      data_iter.set_state(data_state)
      print(f"resumed from {ckpt.directory}/{start}", flush=True)

    stop = c.num_steps if c.stop_at_step < 0 else min(c.stop_at_step, c.num_steps)
    writer = metrics_lib.MetricWriter(self.workdir, c.num_steps, start, c.progress_bar)
    tokens_per_step = c.data.batch_size * c.data.seq_len
    flops_per_token = model_config.flops_per_token(self.model_cfg, c.data.seq_len)
    peak = c.hardware.peak_flops_per_device or measure_peak_flops()
    timed_steps, timed_seconds, eval_loss = 0, 0.0, None
    window_start, window_steps = time.perf_counter(), 0
    run_start = time.perf_counter()
    for step in range(start + 1, stop + 1):
      batch = jax.device_put(next(data_iter), self.batch_sharding())
      state, step_metrics = train_step(state, batch)
      window_steps += 1
      logged = {}
      if step % c.log_every == 0 or step == stop:
        logged = jax.device_get(step_metrics)
        elapsed = time.perf_counter() - window_start
        if step > start + 1 or window_steps > 1:  # windows including the compile are not timed
          if step - window_steps > start:
            timed_steps += window_steps
            timed_seconds += elapsed
        logged["tokens_per_s"] = window_steps * tokens_per_step / elapsed
        logged["mfu"] = logged["tokens_per_s"] * flops_per_token / (peak * self.mesh.devices.size)
        window_start, window_steps = time.perf_counter(), 0
      if step % c.eval.every == 0 or step == c.num_steps:
        eval_loss = self.evaluate(eval_step, state.params, eval_batches)
        logged["eval_loss"] = eval_loss
        window_start = time.perf_counter()
      if logged:
        writer.write(step, logged)
      if step % c.checkpoint.every == 0 or step == stop:
        ckpt.save(step, state, data_iter.get_state())
    ckpt.close()
    writer.close()
    wall = time.perf_counter() - run_start

    tokens_per_s = timed_steps * tokens_per_step / timed_seconds if timed_seconds else float("nan")
    summary = self._summary(stop, eval_loss, wall, tokens_per_s, flops_per_token, peak)
    if stop == c.num_steps:
      (self.workdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    self.final_state = state
    self.final_data_state = data_iter.get_state()
    return summary

  def _summary(self, steps, eval_loss, wall, tokens_per_s, flops_per_token, peak) -> dict:
    c = self.config
    workers = self.mesh.shape[mesh_lib.DATA]
    # Data-parallel: a ring all-reduce of the float32 gradient every step.
    per_step = 2 * (workers - 1) / workers * 4 * self.num_params if workers > 1 else 0.0
    return {
        "algorithm": c.algorithm,
        "config": json.loads(c.to_json_best_effort()),
        "steps": steps,
        "tokens": steps * c.data.batch_size * c.data.seq_len,
        "final_eval_loss": eval_loss,
        "num_params": self.num_params,
        "bytes_sent_per_worker": {
            "workers": workers,
            "total": per_step * steps,
            "peak_per_sync": per_step,
            "bits_per_param_per_step": 8 * per_step / self.num_params,
        },
        "wall_time_s": wall,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / (peak * self.mesh.devices.size),
        "peak_flops_per_device": peak,
        "mesh": dict(self.mesh.shape),
        "workdir": str(self.workdir.absolute()),
    }


def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
  """Trains as `config` says and returns the summary (also written to workdir/summary.json)."""
  return Trainer(config, workdir).run()
