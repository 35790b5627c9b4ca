"""The Trainer: validated config in, a run directory out. The one training loop of the package.

Outputs in the workdir: config.json, tokenizer/ (a copy of the run's, `train.run_inputs`),
run.lock (locked while a start runs), metrics.jsonl, tensorboard/, checkpoints/
(orbax; train state + data iterator state, sealed by checksums) and summary.json
(strict JSON). Restarting with the same workdir and config resumes from the
latest intact checkpoint and ends bit-identical to an uninterrupted run; a
finished run is left as it is (what a workdir may hold: `train.workdir`). The
algorithm (`optim.replicated`) and the source of the gradients (`train.sources`:
replicas, SkipPipe paths, the pipeline executor) are whatever the config names;
the loop knows neither.
"""

from __future__ import annotations

import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lowcomm_jax import (
  codecs,
  comm,
  config as config_lib,
  distributed,
  mesh as mesh_lib,
  run_config,
  sharding,
)
from lowcomm_jax.cpu_kernels import attention as cpu_attention
from lowcomm_jax.data import corpora, pipeline, tokenizer as tokenizer_lib
from lowcomm_jax.models import config as model_config, hf_llama, llama, loss as loss_lib
from lowcomm_jax.optim.inner import TrainState
from lowcomm_jax.train import (
  algorithms,
  checkpoint,
  faults,
  hooks as hooks_lib,
  overlap as overlap_lib,
  run_inputs,
  sources,
  startup,
  validation,
  workdir as workdir_lib,
)


@functools.lru_cache(maxsize=16)
def _abstract_model(model_cfg, seed: int):
  """(graphdef, abstract parameters as a pure dict, logical axes) of the model: tracing its
  constructor once per model config and seed, not once per Trainer (a sweep builds many)."""
  abstract_model = nnx.eval_shape(lambda: llama.Decoder(model_cfg, nnx.Rngs(seed)))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  return graphdef, abstract_params.to_pure_dict(), llama.logical_axes(abstract_model)


class Trainer:
  """Trains the configured model on the configured corpus with the configured algorithm.

  Every check on the config, the mesh and the workdir happens in the
  constructor, before any compute and before anything is written.
  """

  def __init__(self, config: run_config.RunConfig | ml_collections.ConfigDict,
               workdir: str | pathlib.Path, devices=None):
    self.config = config = validation.checked(config)  # a ConfigDict is checked and parsed here
    self.workdir = workdir_lib.check_path(workdir)  # reliability: empty, a file, unwritable
    try:
      self.mesh = mesh_lib.make_mesh(config.mesh.to_dict(), devices)
    except ValueError as error:
      raise ValueError(
        f"{error}{startup.fake_devices_hint(config.mesh.to_dict(), devices)}"
      ) from None
    distributed.check_mesh(self.mesh, config.num_replicas)
    data_ways = self.mesh.shape[mesh_lib.DATA]
    if config.data.batch_size % data_ways:
      raise ValueError(f"data.batch_size={config.data.batch_size} is not divisible by the mesh's "
                       f"data axis ({data_ways}); choose a multiple of {data_ways} or change "
                       f"mesh.data")
    micro = config.data.batch_size // config.optimizer.accumulation_steps
    if micro % data_ways:
      raise ValueError(f"optimizer.accumulation_steps={config.optimizer.accumulation_steps} leaves "
                       f"micro-batches of {micro} rows, not divisible by the mesh's data axis "
                       f"({data_ways}); choose accumulation_steps so that data.batch_size / "
                       f"accumulation_steps is a multiple of {data_ways}")
    if config.eval.batch_size % data_ways:
      raise ValueError(f"eval.batch_size={config.eval.batch_size} is not divisible by the mesh's "
                       f"data axis ({data_ways})")
    self.model_cfg = config_lib.model_config_of(config)
    if self.model_cfg.attention == "cpu_kernel":
      platforms = sorted({d.platform for d in self.mesh.devices.flat})
      if platforms != ["cpu"]:
        raise ValueError(f"model.attention='cpu_kernel' runs on CPU devices only, the mesh "
                         f"has {platforms} (use model.attention='xla')")
      try:
        # compiled (or found in the cache) now: a missing compiler or an untrusted cache fails here
        cpu_attention.load()
      except RuntimeError as error:
        raise ValueError(str(error)) from None
    if config.init_from.startswith(hf_llama.PREFIX):
      hf_llama.check_folder(config.init_from[len(hf_llama.PREFIX):], self.model_cfg)
      hf_llama.check_tokenizer(config.init_from[len(hf_llama.PREFIX):],
                               tokenizer_lib.load_tokenizer(config.data.tokenizer))
    elif config.init_from and not (pathlib.Path(config.init_from) / "checkpoints").is_dir():
      raise ValueError(f"init_from={config.init_from!r} holds no checkpoints/ of a finished run")
    elif config.init_from and not (pathlib.Path(config.init_from) / "config.json").is_file():
      raise ValueError(f"init_from={config.init_from!r} holds checkpoints/ but no config.json, so "
                       f"the model they hold is unknown; give the workdir of a run (both are in "
                       f"it)")
    self.rules = sharding.rules_for(config.sharding.layout)
    # reliability: another config, another corpus, run files without config.json, a finished run
    self.corpus_identity = corpora.corpus_identity(config.data.corpus, config.data.tokenizer)
    self.inputs = run_inputs.describe(config)  # reliability: the tokenizer and tokens file it reads
    self._check_workdir()
    self.graphdef, abstract_params, axes = _abstract_model(self.model_cfg, config.seed)
    abstract_params = jax.tree.map(lambda x: x, abstract_params)  # this Trainer's own dicts
    self.algorithm = algorithms.make_algorithm(config, config.num_replicas, abstract_params)
    self.fragment_names = getattr(self.algorithm, "fragment_names", [])
    self.source = sources.make_source(config, self.graphdef, self.model_cfg, self.algorithm,
                                      self.mesh)
    # thread | inline: where an overlapped fragment's mean is issued (train.overlap)
    self.overlap_executor = overlap_lib.choose(config.outer.overlap_executor, self.algorithm,
                                               self.source, self.mesh)
    self._carrier = overlap_lib.Inline()  # the running loop's (run() starts the configured one)
    self.axes = dict(axes)
    self.param_specs = sharding.param_specs(self.axes, abstract_params, self.rules, self.mesh)
    self.param_shardings = sharding.named(self.mesh, self.param_specs)
    self.num_params = model_config.param_count(self.model_cfg)
    self._programs: dict = {}
    self._traced_entries: dict = {}
    self._refused_seen = None

  def startup_report(self) -> list[str]:
    """The start-up line (model, parameters, mesh and devices, tokens per step, algorithm,
    workdir) and the warnings about the layout, as the run prints them."""
    return ([startup.startup_line(self.config, self.model_cfg, self.num_params, self.mesh,
                                  self.workdir, self.codec_kernel)]
            + startup.startup_warnings(self.config, self.mesh, self.param_specs))

  @property
  def codec_kernel(self) -> str | None:
    """What encodes and decodes the outer gradients on the wire on this run's devices
    (`codecs.kernel_choice`: `pallas_mosaic_gpu`, `pallas_triton`, `pallas_tpu`,
    `pallas_interpret_*`, `reference`); None where no codec encodes them."""
    tx = getattr(self.algorithm, "tx", None)
    if getattr(tx, "codec", None) is None or not hasattr(tx, "codec_kernels"):
      return None
    device = self.mesh.devices.flat[0]
    return codecs.kernel_choice(tx.codec_kernels, tx.codec, device.platform,
                                device if device.platform == "gpu" else None)

  def _check_workdir(self) -> None:
    self.run_state = workdir_lib.check_workdir(
        self.workdir, config_lib.fingerprint(self.config),
        config_lib.fingerprint(config_lib.default_config()), self.corpus_identity, self.inputs)
    self.resuming = self.run_state != workdir_lib.NEW

  # -- building blocks, also used by tests and benchmarks ----------------------------------------

  def init_params(self):
    """The initial (unreplicated) parameters, sharded by the layout's rules.

    With `init_from`, the evaluated parameters of that run's latest checkpoint (replica 0 or φ),
    or with `init_from=hf:<folder>` that Hugging Face Llama folder's weights.
    """
    if self.config.init_from.startswith(hf_llama.PREFIX):
      _, params = hf_llama.read_folder(self.config.init_from[len(hf_llama.PREFIX):])
      return jax.device_put(params, self.param_shardings)
    if self.config.init_from:
      return self._params_from(pathlib.Path(self.config.init_from))
    cfg, seed = self.model_cfg, self.config.seed
    init = lambda: nnx.state(llama.Decoder(cfg, nnx.Rngs(seed)), nnx.Param).to_pure_dict()
    return jax.jit(init, out_shardings=self.param_shardings)()

  def init_state(self) -> TrainState:
    """Replicated parameters [M, ...] (grid [R, S, ...] for the pipeline) and the algorithm's
    state."""
    params = self.init_params()
    abstract = jax.eval_shape(self._init_fn, params)
    return jax.jit(self._init_fn, out_shardings=self.state_shardings(abstract))(params)

  def _params_from(self, workdir: pathlib.Path):
    model_cfg, params = checkpoint.restore_eval_params(workdir)  # sharded as that run had them
    if model_cfg != self.model_cfg:
      raise ValueError(f"init_from={str(workdir)!r} has model {model_cfg}, this "
                       f"run {self.model_cfg}")
    return jax.device_put(params, self.param_shardings)  # resharded device to device

  def restore_latest(self) -> TrainState:
    """The train state of this workdir's latest checkpoint that restores, read only
    (`checkpoint.read_latest`)."""
    return checkpoint.read_latest(self.workdir, self.abstract_state(), "--workdir")[1]

  def _init_fn(self, params):
    params_r, opt_state = self.source.init(params)
    return TrainState(params_r, opt_state, jnp.zeros((), jnp.int32))

  def state_shardings(self, abstract_state):
    return self.source.state_shardings(abstract_state, self.param_specs, self.abstract_params())

  def abstract_params(self):
    """The model's (unreplicated) parameters as `ShapeDtypeStruct`s (no compute)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                        jax.eval_shape(lambda: nnx.state(llama.Decoder(self.model_cfg, nnx.Rngs(0)),
                                                         nnx.Param).to_pure_dict()))

  def batch_sharding(self) -> NamedSharding:
    return self.source.batch_sharding()

  def step_fn(self, phase, route=None):
    """(state, batch [M, B, T+1]) -> (state, metrics) for one static phase (and pipeline
    routing)."""
    return self.source.train_step(phase, route)

  def _jit_step(self, key, state):
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(self.step_fn(*key), in_shardings=(shardings, self.batch_sharding()),
                   out_shardings=(shardings, None), donate_argnums=0)

  def _abstract_batch(self) -> jax.ShapeDtypeStruct:
    c = self.config
    return jax.ShapeDtypeStruct((c.num_replicas, c.data.batch_size, c.data.seq_len + 1), jnp.int32,
                                sharding=self.batch_sharding())

  def program(self, phase, state, route=None):
    """The compiled step of a phase and the ledger entries its collectives recorded (cached)."""
    key = (phase, route)
    if key not in self._programs:
      ledger = comm.Ledger()
      with ledger.recording(), mesh_lib.tracing(self.mesh):
        compiled = self._jit_step(key, state).lower(state, self._abstract_batch()).compile()
      self._programs[key] = (compiled, ledger.entries)
    return self._programs[key]

  def lower(self, phase, state, route=None, platforms=None):
    """The step of a phase lowered, not compiled, for `platforms` (e.g. `("tpu",)` from a CPU host;
    default: the mesh's), as `program` would compile it."""
    with mesh_lib.tracing(self.mesh):
      traced = self._jit_step((phase, route), state).trace(state, self._abstract_batch())
      return traced.lower(lowering_platforms=platforms)

  def abstract_state(self):
    """The train state as `ShapeDtypeStruct`s laid out as `init_state` lays it out (no compute)."""
    abstract = jax.eval_shape(self._init_fn, self.abstract_params())
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        abstract, self.state_shardings(abstract))

  def phase_entries(self, phase, state, route=None) -> list:
    """The ledger entries of a phase's program, traced (not compiled) when not compiled yet."""
    if (phase, route) in self._programs:
      return self._programs[(phase, route)][1]
    if (phase, route) not in self._traced_entries:
      ledger = comm.Ledger()
      with ledger.recording(), mesh_lib.tracing(self.mesh):
        self._jit_step((phase, route), state).trace(state, self._abstract_batch())
      self._traced_entries[(phase, route)] = ledger.entries
    return self._traced_entries[(phase, route)]

  def comm_events(self, num_steps: int, state) -> list:
    """The run's transfers as `sim.clock.CommEvent`s: the algorithm's plans (their ledger entries,
    `Entry.plan`), and the gradient source's own (the pipeline's stage-to-stage messages, which
    depend on the step's routing)."""
    from lowcomm_jax.sim import clock  # pylint: disable=g-import-not-at-top
    entries_of = lambda phase: self.phase_entries(phase, state, self.source.route_at(1))
    entries_at = lambda step: self.phase_entries(self.algorithm.phase_at(step), state,
                                                 self.source.route_at(step))
    return ([clock.CommEvent(*e) for e in self.algorithm.comm_events(
                num_steps, entries_of, self.mesh.shape[mesh_lib.DATA], self.num_params)]
            + self.source.comm_events(num_steps, entries_at))

  def simulated_wall_time(self, num_steps: int, step_seconds: float, state) -> float:
    """Wall time of `num_steps` steps of `step_seconds` on `config.network` (sim.clock)."""
    from lowcomm_jax.sim import clock  # pylint: disable=g-import-not-at-top
    timeline = clock.simulate_run(step_seconds, self.comm_events(num_steps, state),
                                  self.config.network, num_steps=num_steps)
    return timeline.wall_seconds

  def eval_fn(self):
    """(state, batch) -> {"eval_loss": loss of the evaluated parameters, ...}.

    Without a global model (NoLoCo), "eval_loss" is the replicas' mean slow weights and
    "eval_loss_replica_<i>" each replica's own current weights θ_i.
    """
    algorithm, source = self.algorithm, self.source
    loss = loss_lib.jitted_loss(self.graphdef)

    def eval_loss(state, batch):
      losses = {"eval_loss": loss(source.eval_params(state), batch)}
      if algorithm.eval_replicas:
        per_replica = jax.vmap(lambda p: loss(p, batch))(
            source.replica_params(state.params))
        losses.update(
          {f"eval_loss_replica_{i}": per_replica[i] for i in range(algorithm.num_replicas)}
        )
      return losses

    return jax.jit(eval_loss, in_shardings=(None, self.eval_sharding()))

  def eval_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(mesh_lib.DATA, None))

  def evaluate(self, eval_step, state, eval_batches, splits=None) -> dict:
    """Mean eval losses (nats per token) over `eval_batches`, and with `splits` the eval loss in
    bits per byte of the eval text (`eval_bits_per_byte`, `pipeline.TokenSplits.bits_per_byte`)."""
    self._carrier.quiet()  # before dispatching: the evaluation's programs span every process
    losses = distributed.fetch([eval_step(state, b) for b in eval_batches])
    means = {k: float(np.mean([l[k] for l in losses])) for k in losses[0]}
    if splits is not None:
      means["eval_bits_per_byte"] = splits.bits_per_byte(means["eval_loss"])
    return means

  def data_iterators(self, tokens):
    """Iterators of the replicas this process feeds (all of them with a single process)."""
    c = self.config
    return [iter(pipeline.train_dataset(tokens, c.data.seq_len, c.data.batch_size, c.seed,
                                        shard_index=r, num_shards=c.num_replicas))
            for r in distributed.local_replicas(self.mesh, c.num_replicas)]

  def refused(self, state) -> np.ndarray:
    """Outer steps refused so far because the global model would hold NaN or inf (flat int
    array)."""
    return np.asarray(self.fetch(self.refused_array(state))).reshape(-1)

  def fetch(self, tree):
    """`distributed.fetch`, once no collective of the outer-communication thread is running (with
    several processes, the two threads' collectives must not interleave differently per process)."""
    self._carrier.quiet()
    return distributed.fetch(tree)

  def refused_array(self, state) -> jax.Array:
    """The refusal counts of `state` as a device array (`refused` fetches them)."""
    return self.algorithm.refused(self.source.opt_state_view(state.opt_state))

  # -- the run -----------------------------------------------------------------------------------

  def run(self, hooks=()) -> dict:
    """Trains to the end (or `stop_at_step`) holding the workdir's lock (`workdir.RunLock`);
    `hooks` (`train.hooks.Hook`) run after the loop's own at every step."""
    if self.run_state == workdir_lib.COMPLETE:  # reliability: a finished run is left as it is
      return workdir_lib.report_complete(self.workdir)
    self._lock, self._hooks = None, []
    workdir_lib.check_not_locked(self.workdir)  # a second start: refused before its first line
    try:
      return self._run(list(hooks))
    except BaseException:
      hooks_lib.close_quietly(self._hooks)  # a save in flight is finished and sealed
      raise
    finally:  # the kernel would release it at exit; a process that starts another run must not wait
      self._carrier = overlap_lib.Inline()
      if self._lock is not None:
        self._lock.release()

  def _start(self, splits):
    """Locks the workdir, writes config.json (a new run) and returns (the step this start resumes
    from, its state, what the checkpoint recorded of the starts before, the checkpointer)."""
    c = self.config
    if distributed.is_primary():
      for line in self.startup_report():
        print(line, flush=True)
    # reliability: config.json only once the data checks passed (a refusal writes nothing),
    # and only by the start holding the workdir (a second start is refused, naming the first)
    self._lock = workdir_lib.lock_run(self.workdir)
    self._check_workdir()  # again, now that no other start can change it (one may have ended since)
    distributed.barrier("workdir checked")  # by every process, before process 0 writes to it
    if self.run_state == workdir_lib.COMPLETE:
      return None
    if not self.resuming and distributed.is_primary():  # config.json, then the tokenizer's copy
      workdir_lib.write_config(self.workdir, c.to_dict(),
                               config_lib.fingerprint(c), self.corpus_identity, self.inputs)
    elif distributed.is_primary() and run_inputs.saved_inputs(self.workdir):
      run_inputs.copy_tokenizer(self.workdir, self.inputs)  # a first start cut short before it
    distributed.barrier("config.json written")
    state = self.init_state()
    checkpoint.check_writable(self.workdir)  # reliability: before the first step, not at a save
    ckpt = checkpoint.Checkpointer(self.workdir, c.checkpoint.keep)
    restored = ckpt.restore_latest(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    if not restored:
      self._refused_seen = np.zeros_like(self.refused(state))
      return 0, state, {}, ckpt
    start, state, data_state = restored
    self._refused_seen = self.refused(state)  # refusals before the checkpoint were reported
    print(f"resumed from {ckpt.directory}/{start}", flush=True)
    return start, state, data_state, ckpt

  def _run(self, user_hooks: list) -> dict:
    c = self.config
    splits = pipeline.splits_of(c)  # the data's refusals (binary text, too few tokens) come first
    data_iters = self.data_iterators(splits.train)
    eval_batches = [distributed.replicated_array(b, self.eval_sharding())
                    for b in pipeline.eval_batches(splits.eval, c.data.seq_len, c.eval.batch_size,
                                                   c.eval.num_batches)]
    started = self._start(splits)
    if started is None:
      return workdir_lib.report_complete(self.workdir)
    start, state, restored, ckpt = started
    if start:
      mine = distributed.local_replicas(self.mesh, c.num_replicas)
      for it, s in zip(data_iters, restored["replicas"][mine.start:mine.stop]):
        it.set_state(s)
    stop = c.num_steps if c.stop_at_step < 0 else min(c.stop_at_step, c.num_steps)
    step_metrics = hooks_lib.StepMetrics(self, start, stop, restored)
    refusals = hooks_lib.Refusals(self, stop)
    evaluation = hooks_lib.Evaluation(self, step_metrics, eval_batches, splits)
    hooks = self._hooks = [step_metrics, refusals, evaluation,
                           hooks_lib.Checkpoints(self, ckpt, step_metrics, refusals, stop),
                           *user_hooks]
    carrier = overlap_lib.start(self.overlap_executor, self.algorithm, self.mesh)
    state = self.train(state, start, stop, data_iters, carrier, hooks)
    if evaluation.losses is None and start == stop == c.num_steps:  # killed before the summary
      evaluation.evaluate(state)
    eval_losses = evaluation.losses or {}
    self._carrier = overlap_lib.Inline()
    for hook in hooks:
      hook.close()
    return self._summary(stop, start, eval_losses, step_metrics, splits, state)

  def train(self, state, start: int, stop: int, data_iters: list, carrier, hooks: list):
    """The loop: steps start + 1 … stop from `state` on the batches of `data_iters` (this process's
    replicas), the outer communication through `carrier` (`train.overlap`: Inline, Threaded,
    Remote; one that replaces the state moves the loop on, `position`), `hooks` (`train.hooks`)
    around each step; returns the state after the last step."""
    c = self.config
    self._carrier = carrier
    loop = hooks_lib.Loop(self, carrier, start, stop, data_iters)
    for hook in hooks:
      hook.begin(loop)
    step = start
    while step < stop:
      step += 1
      phase = self.algorithm.phase_at(step)
      route = self.source.route_at(step)
      # The carrier picks the phase the step's program runs: with a thread or a syncer, without the
      # sends it carries itself (submitted here) and the merges of their results (its after_step
      # runs them once they arrived, so the step's compute overlaps the transfer).
      step_phase, state = carrier.before_step(step, phase, state)
      program, _ = self.program(step_phase, state, route)
      batch = distributed.global_array(  # this process's replicas only
          np.stack([next(it) for it in data_iters]), self.batch_sharding(),
          (c.num_replicas, c.data.batch_size, c.data.seq_len + 1))
      state, metrics = program(state, batch)
      for hook in hooks:
        hook.dispatched(step, state, metrics)
      state = carrier.after_step(state)
      for hook in hooks:
        state = hook.after_step(step, phase, state, metrics)
      step = carrier.position(step)  # later where the carrier replaced the state (a rejoin)
    state = carrier.settle(state)
    carrier.close()
    for hook in hooks:
      hook.end(state)
    return state

  def check_refused(self, counts, step: int) -> None:
    """Applies config.nonfinite after new refusals of an outer step (`counts`: the device array
    `refused_array` gives): raise, or log and go on."""
    counts = np.asarray(self.fetch(counts)).reshape(-1)
    new = [i for i in range(len(counts)) if counts[i] > self._refused_seen[i]]
    self._refused_seen = counts
    if not new:
      return
    names = self.algorithm.refusal_names()
    what = ", ".join(names[i] if i < len(names) else f"entry {i}" for i in new)
    message = (f"by step {step}: {what} held NaN or inf; the outer step was refused and the "
               "global model kept")
    if self.config.nonfinite == "raise":
      from lowcomm_jax.codecs import NonFiniteError  # pylint: disable=g-import-not-at-top
      raise NonFiniteError(message + " (set nonfinite=skip to go on, e.g. with a lower "
                           "learning rate)")
    print("warning: " + message, flush=True)

  def _summary(self, steps: int, start: int, eval_losses: dict, step_metrics, splits,
               state) -> dict:
    c = self.config
    final = {k: float(self.fetch(v)) for k, v in self.algorithm.final_diagnostics(
        self.source.opt_state_view(state.opt_state)).items()}
    throughput, wall = step_metrics.throughput, time.perf_counter() - step_metrics.began
    tokens_per_step = c.num_replicas * c.data.batch_size * c.data.seq_len
    summary = {
        "algorithm": c.algorithm,
        "gradients": c.gradients,
        "config": c.to_dict(),
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "final_eval_loss": eval_losses.get("eval_loss"),
        "num_params": self.num_params,
        "bytes_sent_per_worker": self.algorithm.comm_summary(
            steps, step_metrics.sent_bytes, step_metrics.peak_sync_bytes,
            self.mesh.shape[mesh_lib.DATA], self.num_params),
        "refused_outer_steps": int(self.refused(state).sum()),
        # the whole run's (every start's work up to the checkpoint the next start resumed from)
        "wall_time_s": step_metrics.earlier_wall + wall,
        "tokens_per_s": throughput.tokens_per_s,
        "mesh": dict(self.mesh.shape),
        "codec_kernel": self.codec_kernel,
        "workdir": str(self.workdir.absolute()),
        **final,
        # this start's own figures beside them
        "this_start": {"first_step": start + 1, "wall_time_s": wall,
                       "tokens_per_s": throughput.start_tokens_per_s},
        "final_eval_bits_per_byte": eval_losses.get("eval_bits_per_byte"),
        "eval_bytes_per_token": splits.bytes_per_token,
        **throughput.summary(),
    }
    if self.algorithm.eval_replicas:  # no global model: each replica's loss
      summary["final_eval_loss_replicas"] = [eval_losses.get(f"eval_loss_replica_{i}")
                                             for i in range(c.num_replicas)]
    if c.network:
      step_seconds = c.hardware.step_seconds or tokens_per_step / throughput.tokens_per_s
      # replicas of the declared speeds (elastic.speeds): every step of the SPMD program waits for
      # the slowest
      step_seconds *= max(faults.slowdowns(c.elastic.speeds, c.elastic.num_learners))
      summary["network"] = c.network
      summary["simulated_step_seconds"] = step_seconds
      summary["simulated_wall_time_s"] = self.simulated_wall_time(steps, step_seconds, state)
    if steps == c.num_steps and distributed.is_primary():  # strict JSON, nulls explained
      untimed = "no timed step: every step of this start was in the window that compiles"
      why_null = {"this_start.tokens_per_s": untimed}
      why_null.update({} if throughput.seconds else {
          k: untimed for k in ("tokens_per_s", "tokens_per_cpu_s", "mfu") if k in summary})
      summary = workdir_lib.write_summary(self.workdir, summary, why_null)
    return summary


def run(config: run_config.RunConfig | ml_collections.ConfigDict,
        workdir: str | pathlib.Path) -> dict:
  """Trains as `config` says and returns the summary (also written to workdir/summary.json)."""
  return Trainer(config, workdir).run()
