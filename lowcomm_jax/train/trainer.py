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
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lowcomm_jax import comm
from lowcomm_jax import config as config_lib
from lowcomm_jax import distributed
from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax import sharding
from lowcomm_jax.data import pipeline
from lowcomm_jax.models import config as model_config
from lowcomm_jax.models import llama
from lowcomm_jax.optim.noloco import weight_spread
from lowcomm_jax.train import algorithms, checkpoint, clock_events
from lowcomm_jax.train import metrics as metrics_lib, mfu as mfu_lib, step as step_lib


class Trainer:
  """Trains the configured model on the configured corpus with the configured algorithm.

  Every check on the config, the mesh and the workdir happens in the
  constructor, before any compute and before anything is written.
  """

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | pathlib.Path, devices=None):
    config_lib.validate(config)
    self.config = config
    self.workdir = pathlib.Path(workdir)
    self.mesh = mesh_lib.make_mesh(config.mesh.to_dict(), devices)
    distributed.check_mesh(self.mesh, config.num_replicas)
    data_ways = self.mesh.shape[mesh_lib.DATA]
    if config.data.batch_size % data_ways:
      raise ValueError(f"data.batch_size={config.data.batch_size} is not divisible by the mesh's "
                       f"data axis ({data_ways}); choose a multiple of {data_ways} or change mesh.data")
    if config.eval.batch_size % data_ways:
      raise ValueError(f"eval.batch_size={config.eval.batch_size} is not divisible by the mesh's "
                       f"data axis ({data_ways})")
    preset = model_config.PRESETS.get(config.model.size)
    self.model_cfg = model_config.get_model_config(
        config.model.size, dtype=config.model.dtype, layer_loop=config.model.layer_loop,
        max_seq_len=max(preset.max_seq_len, config.data.seq_len),
        d_ff=config.model.d_ff or preset.d_ff)
    if config.init_from and not (pathlib.Path(config.init_from) / "checkpoints").is_dir():
      raise ValueError(f"init_from={config.init_from!r} holds no checkpoints/ of a finished run")
    self.rules = sharding.rules_for(config.sharding.layout)
    self.algorithm = algorithms.make_algorithm(config, config.num_replicas)
    self.resuming = checkpoint.check_workdir(self.workdir, config_lib.fingerprint(config),
                                             config_lib.fingerprint(config_lib.default_config()))
    abstract_model = nnx.eval_shape(lambda: llama.Decoder(self.model_cfg, nnx.Rngs(config.seed)))
    self.graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    abstract_params = abstract_params.to_pure_dict()
    self.fragment_names, self._nonfinite_seen = [], {}
    if self.algorithm.streaming:  # a fragment rule that misses parameters fails here, before compute
      self.fragment_names = [f.name for f in self.algorithm.tx.fragments(abstract_params)]
    self.axes = llama.logical_axes(abstract_model)
    self.param_specs = sharding.param_specs(self.axes, abstract_params, self.rules, self.mesh)
    self.param_shardings = sharding.named(self.mesh, self.param_specs)
    self.num_params = model_config.param_count(self.model_cfg)
    self._programs: dict = {}

  # -- building blocks, also used by tests and benchmarks ----------------------------------------

  def init_params(self):
    """The initial (unreplicated) parameters, sharded by the layout's rules.

    With `init_from`, the evaluated parameters of that run's latest checkpoint (replica 0 or φ).
    """
    if self.config.init_from:
      return self._params_from(pathlib.Path(self.config.init_from))
    cfg, seed = self.model_cfg, self.config.seed
    init = lambda: nnx.state(llama.Decoder(cfg, nnx.Rngs(seed)), nnx.Param).to_pure_dict()
    return jax.jit(init, out_shardings=self.param_shardings)()

  def init_state(self) -> step_lib.TrainState:
    """Replicated parameters [M, ...] and the algorithm's state, laid out on the mesh."""
    params = self.init_params()
    abstract = jax.eval_shape(self._init_fn, params)
    return jax.jit(self._init_fn, out_shardings=self.state_shardings(abstract))(params)

  def _params_from(self, workdir: pathlib.Path):
    other = Trainer(config_lib.load_run_config(workdir), workdir)
    if other.model_cfg != self.model_cfg:
      raise ValueError(f"init_from={str(workdir)!r} has model {other.model_cfg}, this run {self.model_cfg}")
    state = other.restore_latest()
    params = other.algorithm.eval_params(state.params, state.opt_state)
    return jax.device_put(params, self.param_shardings)

  def restore_latest(self) -> step_lib.TrainState:
    """The train state of this workdir's latest checkpoint."""
    abstract = jax.eval_shape(self._init_fn, self._abstract_params())
    shardings = self.state_shardings(abstract)
    template = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            abstract, shardings)
    ckpt = checkpoint.Checkpointer(self.workdir, self.config.checkpoint.keep)
    restored = ckpt.restore_latest(template)
    ckpt.close()
    if restored is None:
      raise ValueError(f"{self.workdir} has no checkpoint to restore")
    return restored[1]

  def _init_fn(self, params):
    params_r, opt_state = self.algorithm.init(params)
    return step_lib.TrainState(params_r, opt_state, jnp.zeros((), jnp.int32))

  def state_shardings(self, abstract_state):
    """Shardings of a train state: a leaf whose path ends with a parameter's path and has its shape
    gets that parameter's spec; per-replica leaves get `replica` in front; the rest is replicated."""
    batched = step_lib.TrainState(
        params=jax.tree.map(lambda _: True, abstract_state.params),
        opt_state=jax.tree.map(lambda axis: axis == 0, jax.tree.broadcast(
            self.algorithm.state_axes, abstract_state.opt_state, is_leaf=lambda x: x is None),
                               is_leaf=lambda x: x is None),
        step=False)
    flat_specs = {llama.path_name(k): s for k, s in jax.tree_util.tree_flatten_with_path(
        self.param_specs, is_leaf=lambda x: isinstance(x, P))[0]}
    shapes = {llama.path_name(k): v.shape
              for k, v in jax.tree_util.tree_flatten_with_path(self._abstract_params())[0]}

    def sharding_of(key_path, leaf, is_batched):
      name = llama.path_name(key_path)
      shape = leaf.shape[1:] if is_batched else leaf.shape
      spec = ()
      for param_name, param_spec in flat_specs.items():
        if (name == param_name or name.endswith("/" + param_name)) and shapes[param_name] == shape:
          spec = tuple(param_spec)
          break
      lead = (mesh_lib.REPLICA,) if is_batched else ()
      return NamedSharding(self.mesh, P(*lead, *spec))

    return jax.tree_util.tree_map_with_path(sharding_of, abstract_state, batched)

  def _abstract_params(self):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                        jax.eval_shape(lambda: nnx.state(llama.Decoder(self.model_cfg, nnx.Rngs(0)),
                                                         nnx.Param).to_pure_dict()))

  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(mesh_lib.REPLICA, mesh_lib.DATA, None))

  def step_fn(self, phase):
    """(state, batch [M, B, T+1]) -> (state, metrics) for one static phase of the algorithm."""
    graphdef, tx, axes = self.graphdef, self.algorithm.tx, self.algorithm.state_axes
    kwargs = {"phase": phase} if self.algorithm.phased else {}

    def per_replica(params, opt_state, batch):
      loss, grads = jax.value_and_grad(lambda p: step_lib.lm_loss(graphdef, p, batch))(params)
      updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
      return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    if self.algorithm.gossip and self.mesh.shape[mesh_lib.REPLICA] > 1:
      replicas = self._one_replica_per_device(per_replica, axes)
    else:
      replicas = jax.vmap(per_replica, in_axes=(0, axes, 0), out_axes=(0, axes, 0, 0),
                          axis_name=mesh_lib.REPLICA)

    def train_step(state: step_lib.TrainState, batch_r):
      params_r, opt_state, loss_r, grad_norm_r = replicas(state.params, state.opt_state, batch_r)
      # Per-replica metrics: averaging them here would put an all-reduce in every step's program.
      return (step_lib.TrainState(params_r, opt_state, state.step + 1),
              {"loss": loss_r, "grad_norm": grad_norm_r})

    return train_step

  def _one_replica_per_device(self, per_replica, axes):
    """`per_replica` under `jax.shard_map` over the `replica` mesh axis, one replica per slice.

    NoLoCo's `lax.ppermute` must stay a collective-permute between devices: under `jax.vmap` on
    replica-sharded inputs, XLA's partitioner lowers the batched permutation to an all-gather over
    the whole axis. The inner axes (data, tensor) stay automatic inside the map.
    """
    lead = P(mesh_lib.REPLICA)
    state_specs = jax.tree.map(lambda a: P() if a is None else lead, axes, is_leaf=lambda a: a is None)
    mapped = jax.tree.map(lambda a: a is not None, axes, is_leaf=lambda a: a is None)

    def on_slice(params, opt_state, batch):
      take = lambda m, t: jax.tree.map(lambda x: x[0], t) if m else t
      put = lambda m, t: jax.tree.map(lambda x: x[None], t) if m else t
      per_leaf = lambda f, t: jax.tree.map(f, mapped, t, is_leaf=lambda a: isinstance(a, bool))
      params, opt_state, loss, grad_norm = per_replica(
          take(True, params), per_leaf(take, opt_state), take(True, batch))
      return put(True, params), per_leaf(put, opt_state), loss[None], grad_norm[None]

    return jax.shard_map(on_slice, mesh=self.mesh, in_specs=(lead, state_specs, lead),
                         out_specs=(lead, state_specs, lead, lead), axis_names={mesh_lib.REPLICA})

  def _jit_step(self, phase, state):
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(self.step_fn(phase), in_shardings=(shardings, self.batch_sharding()),
                   out_shardings=(shardings, None), donate_argnums=0)

  def _abstract_batch(self) -> jax.ShapeDtypeStruct:
    c = self.config
    return jax.ShapeDtypeStruct((c.num_replicas, c.data.batch_size, c.data.seq_len + 1), jnp.int32,
                                sharding=self.batch_sharding())

  def program(self, phase, state):
    """The compiled step of a phase and the ledger entries its collectives recorded (cached)."""
    if phase not in self._programs:
      ledger = comm.Ledger()
      with ledger.recording():
        compiled = self._jit_step(phase, state).lower(state, self._abstract_batch()).compile()
      self._programs[phase] = (compiled, ledger.entries)
    return self._programs[phase]

  def phase_entries(self, phase, state) -> list:
    """The ledger entries of a phase's program, traced (not compiled) when not compiled yet."""
    if phase in self._programs:
      return self._programs[phase][1]
    ledger = comm.Ledger()
    with ledger.recording():
      self._jit_step(phase, state).trace(state, self._abstract_batch())
    return ledger.entries

  def comm_events(self, num_steps: int, state) -> list:
    """The run's collectives as `sim.clock.CommEvent`s (`lowcomm_jax.train.clock_events`)."""
    return clock_events.comm_events(self.algorithm, self.mesh.shape[mesh_lib.DATA], self.num_params,
                                    num_steps, lambda phase: self.phase_entries(phase, state))

  def simulated_wall_time(self, num_steps: int, step_seconds: float, state) -> float:
    """Wall time of `num_steps` steps of `step_seconds` on `config.network` (sim.clock)."""
    from lowcomm_jax.sim import clock  # pylint: disable=g-import-not-at-top
    timeline = clock.simulate_run(step_seconds, self.comm_events(num_steps, state),
                                  self.config.network, num_steps=num_steps)
    return timeline.wall_seconds

  def eval_fn(self):
    """(state, batch) -> {"eval_loss": loss of the evaluated parameters, ...}.

    NoLoCo has no global model: "eval_loss" is the replicas' mean slow weights and
    "eval_loss_replica_<i>" each replica's own current weights θ_i.
    """
    graphdef, algorithm = self.graphdef, self.algorithm

    def eval_loss(state, batch):
      params = algorithm.eval_params(state.params, state.opt_state)
      losses = {"eval_loss": step_lib.lm_loss(graphdef, params, batch)}
      if algorithm.gossip:
        per_replica = jax.vmap(lambda p: step_lib.lm_loss(graphdef, p, batch))(state.params)
        losses.update({f"eval_loss_replica_{i}": per_replica[i] for i in range(algorithm.num_replicas)})
      return losses

    return jax.jit(eval_loss, in_shardings=(None, self.eval_sharding()))

  def eval_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(mesh_lib.DATA, None))

  def evaluate(self, eval_step, state, eval_batches) -> dict:
    losses = distributed.fetch([eval_step(state, b) for b in eval_batches])
    return {k: float(np.mean([l[k] for l in losses])) for k in losses[0]}

  def data_iterators(self, tokens):
    """Iterators of the replicas this process feeds (all of them with a single process)."""
    c = self.config
    return [iter(pipeline.train_dataset(tokens, c.data.seq_len, c.data.batch_size, c.seed,
                                        shard_index=r, num_shards=c.num_replicas))
            for r in distributed.local_replicas(self.mesh, c.num_replicas)]

  # -- the run -----------------------------------------------------------------------------------

  def run(self) -> dict:
    c = self.config
    self.workdir.mkdir(parents=True, exist_ok=True)
    if not self.resuming and distributed.is_primary():
      (self.workdir / "config.json").write_text(json.dumps(
          {"config": json.loads(c.to_json_best_effort()),
           "fingerprint": config_lib.fingerprint(c)}, indent=1, default=str))
    splits = pipeline.load_splits(c.data.corpus, c.data.eval_permille)
    data_iters = self.data_iterators(splits.train)
    eval_batches = [distributed.replicated_array(b, self.eval_sharding())
                    for b in pipeline.eval_batches(splits.eval, c.data.seq_len, c.eval.batch_size,
                                                   c.eval.num_batches)]
    state = self.init_state()
    eval_step = self.eval_fn()

    ckpt = checkpoint.Checkpointer(self.workdir, c.checkpoint.keep)
    restored = ckpt.restore_latest(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    start = restored[0] if restored else 0
    sent_bytes, peak_sync_bytes = 0.0, 0.0  # the ledger's bytes per worker, over the whole run
    if start:
      _, state, data_state = restored
      mine = distributed.local_replicas(self.mesh, c.num_replicas)
      for it, s in zip(data_iters, data_state["replicas"][mine.start:mine.stop]):
        it.set_state(s)
      sent_bytes, peak_sync_bytes = data_state["sent_bytes"], data_state["peak_sync_bytes"]
      if self.algorithm.streaming:  # refusals before the checkpoint were already reported
        self._nonfinite_seen = dict(enumerate(distributed.fetch(state.opt_state.nonfinite).tolist()))
      print(f"resumed from {ckpt.directory}/{start}", flush=True)

    stop = c.num_steps if c.stop_at_step < 0 else min(c.stop_at_step, c.num_steps)
    writer = metrics_lib.MetricWriter(self.workdir, c.num_steps, start, c.progress_bar,
                                      enabled=distributed.is_primary())
    tokens_per_step = c.num_replicas * c.data.batch_size * c.data.seq_len
    flops_per_token = model_config.flops_per_token(self.model_cfg, c.data.seq_len)
    peak = mfu_lib.run_peak_flops(c.hardware.peak_flops_per_device, self.mesh.devices.size)
    timed_steps, timed_seconds, eval_loss, eval_losses = 0, 0.0, None, {}
    window_start, window_steps = time.perf_counter(), 0
    # Logged metrics are fetched one step late (metrics.OneStepBehind), so that logging never makes
    # the host wait for a step before dispatching the next; throughput windows end at the fetch.
    behind = metrics_lib.OneStepBehind(distributed.fetch)

    def take_ready():
      nonlocal window_start, timed_steps, timed_seconds
      record = behind.ready()
      if record is None:
        return None
      held_step, values, fetched_at = record
      window = int(values.pop("_window_steps", 0))
      if window:
        elapsed = fetched_at - window_start
        if held_step - window > start:  # the window holding the first step (compiles) is not timed
          timed_steps += window
          timed_seconds += elapsed
        values["tokens_per_s"] = window * tokens_per_step / elapsed
        values["mfu"] = mfu_lib.mfu(values["tokens_per_s"], flops_per_token, peak)
        window_start = fetched_at
      return held_step, values

    run_start = time.perf_counter()
    for step in range(start + 1, stop + 1):
      phase = self.algorithm.phase_at(step)
      program, entries = self.program(phase, state)
      batch = distributed.global_array(  # this process's replicas only
          np.stack([next(it) for it in data_iters]), self.batch_sharding(),
          (c.num_replicas, c.data.batch_size, c.data.seq_len + 1))
      state, step_metrics = program(state, batch)
      ready = take_ready()  # the last logged step's metrics, fetched now that this step is queued
      if ready:
        writer.write(*ready)
      logged = {}
      if self.algorithm.streaming and phase.receive:
        self._check_nonfinite(state, step, phase)
      if self.algorithm.gossip and phase.grouping is not None:
        logged["weight_spread"] = float(distributed.fetch(weight_spread(state.opt_state.slow)))
      step_bytes = sum(e.sent_bytes for e in entries)
      sent_bytes += step_bytes
      peak_sync_bytes = max(peak_sync_bytes, step_bytes)
      window_steps += 1
      log_now = step % c.log_every == 0 or step == stop
      if log_now:
        logged["_window_steps"], window_steps = window_steps, 0
      if logged:
        behind.hold(step, step_metrics if log_now else {}, logged)
      if step % c.eval.every == 0 or step == c.num_steps:
        _, held = take_ready() or (step, {})  # evaluating waits for this step anyway
        eval_losses = self.evaluate(eval_step, state, eval_batches)
        eval_loss = eval_losses["eval_loss"]
        writer.write(step, {**held, **eval_losses})
        window_start = time.perf_counter()
      if step % c.checkpoint.every == 0 or step == stop:
        ready = take_ready()  # written before the checkpoint, so that a resume never loses its line
        if ready:
          writer.write(*ready)
        data_states = distributed.gather_lists([it.get_state() for it in data_iters])
        ckpt.save(step, state, {"replicas": data_states,
                                "sent_bytes": sent_bytes, "peak_sync_bytes": peak_sync_bytes})
    ckpt.close()
    writer.close()
    wall = time.perf_counter() - run_start

    tokens_per_s = timed_steps * tokens_per_step / timed_seconds if timed_seconds else float("nan")
    summary = self._summary(stop, eval_loss, wall, tokens_per_s, flops_per_token, peak,
                            sent_bytes, peak_sync_bytes)
    if self.algorithm.gossip:  # no global model: each replica's loss and how far apart they are
      summary["final_eval_loss_replicas"] = [eval_losses.get(f"eval_loss_replica_{i}")
                                             for i in range(c.num_replicas)]
      summary["final_weight_spread"] = float(distributed.fetch(weight_spread(state.opt_state.slow)))
    if c.network:
      step_seconds = c.hardware.step_seconds or tokens_per_step / tokens_per_s
      summary["network"] = c.network
      summary["simulated_step_seconds"] = step_seconds
      summary["simulated_wall_time_s"] = self.simulated_wall_time(stop, step_seconds, state)
    if stop == c.num_steps and distributed.is_primary():
      (self.workdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    self.final_state = state
    self.final_data_state = distributed.gather_lists([it.get_state() for it in data_iters])
    return summary

  def _check_nonfinite(self, state, step: int, phase) -> None:
    """Applies diloco.nonfinite after a step that applied fragments: raise, or log and go on."""
    counts = distributed.fetch(state.opt_state.nonfinite)
    bad = [p for p in phase.receive if counts[p] > self._nonfinite_seen.get(p, 0)]
    for p in bad:
      self._nonfinite_seen[p] = int(counts[p])
    if not bad:
      return
    names = ", ".join(f"fragment {p} ({self.fragment_names[p]})" for p in bad)
    message = (f"step {step}: the averaged outer gradient of {names} holds NaN or inf; its outer "
               "step was refused and φ kept")
    if self.config.diloco.nonfinite == "raise":
      from lowcomm_jax.codecs import NonFiniteError  # pylint: disable=g-import-not-at-top
      raise NonFiniteError(message + " (set diloco.nonfinite=skip to go on)")
    print("warning: " + message, flush=True)

  def _comm_summary(self, steps, sent_bytes, peak_sync_bytes) -> dict:
    if self.algorithm.name == "dp":
      # XLA's own gradient all-reduce over the data axis: a float32 ring every step.
      workers = self.mesh.shape[mesh_lib.DATA]
      peak_sync_bytes = comm.ring_factor(workers) * 4 * self.num_params
      sent_bytes = peak_sync_bytes * steps
    else:
      workers = self.config.num_replicas
    return {"workers": workers, "total": sent_bytes, "peak_per_sync": peak_sync_bytes,
            "bits_per_param_per_step": 8 * sent_bytes / (self.num_params * max(steps, 1))}

  def _summary(self, steps, eval_loss, wall, tokens_per_s, flops_per_token, peak, sent_bytes,
               peak_sync_bytes) -> dict:
    c = self.config
    return {
        "algorithm": c.algorithm,
        "config": json.loads(c.to_json_best_effort()),
        "steps": steps,
        "tokens": steps * c.num_replicas * c.data.batch_size * c.data.seq_len,
        "final_eval_loss": eval_loss,
        "num_params": self.num_params,
        "bytes_sent_per_worker": self._comm_summary(steps, sent_bytes, peak_sync_bytes),
        "wall_time_s": wall,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu_lib.mfu(tokens_per_s, flops_per_token, peak),
        "peak_flops": peak,
        "mesh": dict(self.mesh.shape),
        "workdir": str(self.workdir.absolute()),
    }


def run(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict:
  """Trains as `config` says and returns the summary (also written to workdir/summary.json)."""
  return Trainer(config, workdir).run()
