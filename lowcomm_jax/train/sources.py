"""Where a step's gradients come from (`config.gradients`), and how replicas sit on the mesh.

  replicas   each replica's forward/backward on its own batch [B, T+1] (DiLoCo's workers)
  skippipe   each replica's batch split into micro-batches, micro-batch i along stage path i of
             `skippipe.paths` (docs/algorithms.md §3.4: skipped stages get no gradient from it)
  pipeline   the pipeline executor (`parallel.executor`) on the (replica, stage) grid: micro-batches
             routed through the stages with `lax.ppermute`, fixed or at random between the replicas
             of consecutive stages (NoLoCo's routing, docs/algorithms.md §2.2)

Every source then applies the algorithm's `update` per replica with the phase read on the host. The
mesh alone decides how: one replica per `replica` slice under `jax.shard_map` when mesh.replica = M
(a `lax.ppermute` stays a device-to-device permute), `jax.vmap` over M stacked replicas otherwise;
the pipeline's state is in grid layout (leaves [R, S, ...], one slice per device) and its update
runs per device under `jax.shard_map` over (replica, stage).

Each entry of SOURCES pairs the builder with `check_config`, the checks of what that source needs of
the config (its mesh, its micro-batches, its paths); `train.validation.validate` calls the selected
one, and `check_every_section` range-checks the `pipeline` and `skippipe` sections in every run, so
a fourth source brings its checks with it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from lowcomm_jax import checks, mesh as mesh_lib, sharding
from lowcomm_jax.models import loss as loss_lib
from lowcomm_jax.optim.inner import TrainState


def parse_paths(text: str) -> np.ndarray:
  """"0-1-2,0-2-3" → int32 [M, k]: one stage path per micro-batch."""
  try:
    return np.array([[int(s) for s in path.split("-")] for path in text.split(",")], np.int32)
  except ValueError as error:
    raise ValueError(f"skippipe.paths must be stage paths like '0-1-2,0-2-3', "
                     f"got {text!r}") from error


class ReplicaGradients:
  """Per-replica forward/backward on stacked replicas [M, ...] (`replicas` and `skippipe`)."""

  name = "replicas"

  def __init__(self, graphdef, algorithm, mesh, loss_and_grads=None, accumulation_steps: int = 1):
    self.graphdef, self.algorithm, self.mesh = graphdef, algorithm, mesh
    self.loss_and_grads = loss_lib.accumulate(
        loss_and_grads or loss_lib.jitted_loss_and_grads(graphdef), accumulation_steps)

  def route_at(self, step: int):
    return None

  def comm_events(self, num_steps: int, entries_at) -> list:
    """The source's own transfers for the virtual clock: none (the algorithm reports its own)."""
    return []

  def init(self, params):
    return self.algorithm.init_replicated(params, self.algorithm.num_replicas)

  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(mesh_lib.REPLICA, mesh_lib.DATA, None))

  def replica_params(self, params_r):
    return params_r

  def eval_params(self, state):
    return self.algorithm.eval_params(state.params, state.opt_state)

  def opt_state_view(self, opt_state):
    return opt_state

  def state_shardings(self, abstract_state, param_specs, abstract_params):
    """Each leaf laid out like its parameter (`sharding.state_specs`); per-replica leaves get
    `replica` in front; the rest is replicated."""
    batched = TrainState(
        params=jax.tree.map(lambda _: True, abstract_state.params),
        opt_state=jax.tree.map(lambda axis: axis == 0, jax.tree.broadcast(
            self.algorithm.state_axes, abstract_state.opt_state, is_leaf=lambda x: x is None),
                               is_leaf=lambda x: x is None),
        step=False)
    specs = sharding.state_specs(abstract_state, abstract_params, param_specs, batched)
    return sharding.named(self.mesh, specs)

  def train_step(self, phase, route):
    algorithm, axes, loss_and_grads = self.algorithm, self.algorithm.state_axes, self.loss_and_grads

    def per_replica(params, opt_state, batch):
      loss, grads = loss_and_grads(params, batch)
      updates, opt_state = algorithm.update(grads, opt_state, params, phase)
      return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    def replicas(*args):
      if 1 < self.mesh.shape[mesh_lib.REPLICA] == algorithm.num_replicas:
        return self._one_replica_per_slice(per_replica, axes)(*args)
      # With 1 < mesh.replica < M the stacked replicas are sharded over `replica`: laying the vmap
      # axis out over it (read when traced, under `mesh.tracing`) keeps each replica's Δ where it
      # lives, so the codec kernels (a shard_map over every mesh axis) encode it there instead of
      # after an all-gather over the replicas.
      spmd = (mesh_lib.REPLICA if self.mesh.shape[mesh_lib.REPLICA] > 1
              and mesh_lib.REPLICA in jax.sharding.get_abstract_mesh().axis_names else None)
      return jax.vmap(per_replica, in_axes=(0, axes, 0), out_axes=(0, axes, 0, 0),
                      axis_name=mesh_lib.REPLICA, spmd_axis_name=spmd)(*args)

    def train_step(state: TrainState, batch_r):
      params_r, opt_state, loss_r, grad_norm_r = replicas(state.params, state.opt_state, batch_r)
      # Per-replica metrics: averaging them here would put an all-reduce in every step's program.
      return (TrainState(params_r, opt_state, state.step + 1),
              {"loss": loss_r, "grad_norm": grad_norm_r})

    return train_step

  def _one_replica_per_slice(self, per_replica, axes):
    """`per_replica` under `jax.shard_map` over the `replica` mesh axis, one replica per slice.

    A `lax.ppermute` must stay a collective-permute between devices: under `jax.vmap` on
    replica-sharded inputs, XLA's partitioner lowers the batched permutation to an all-gather over
    the whole axis. The inner axes (data, tensor) stay automatic inside the map.
    """
    lead = P(mesh_lib.REPLICA)
    state_specs = jax.tree.map(lambda a: P() if a is None else lead, axes,
                               is_leaf=lambda a: a is None)
    mapped = jax.tree.map(lambda a: a is not None, axes, is_leaf=lambda a: a is None)

    def on_slice(params, opt_state, batch):
      take = lambda m, t: jax.tree.map(lambda x: x[0], t) if m else t
      put = lambda m, t: jax.tree.map(lambda x: x[None], t) if m else t
      per_leaf = lambda f, t: jax.tree.map(f, mapped, t, is_leaf=lambda a: isinstance(a, bool))
      params, opt_state, loss, grad_norm = per_replica(
          take(True, params), per_leaf(take, opt_state), take(True, batch))
      return put(True, params), per_leaf(put, opt_state), loss[None], grad_norm[None]

    return jax.shard_map(on_slice, mesh=mesh_lib.current(self.mesh),
                         in_specs=(lead, state_specs, lead),
                         out_specs=(lead, state_specs, lead, lead), axis_names={mesh_lib.REPLICA})


def skippipe_gradients(graphdef, algorithm, mesh, stage_paths, layers_per_stage: int,
                       accumulation_steps: int = 1):
  """`ReplicaGradients` whose loss runs micro-batch i of a replica's batch along stage path i (of
  each of the `accumulation_steps` parts of the batch, `step.accumulate`)."""
  from lowcomm_jax.skippipe import training  # pylint: disable=g-import-not-at-top
  layer_paths = jnp.asarray(training.layer_order(stage_paths, layers_per_stage))
  num_mb = len(stage_paths)

  @jax.jit  # one function for every phase's program: the model is traced once per run
  def loss_and_grads(params, batch_BxT1):
    microbatches = batch_BxT1.reshape(num_mb, -1, batch_BxT1.shape[-1])
    loss, grads, _ = training.summed_microbatch_grads(graphdef, params, microbatches, layer_paths)
    return loss, grads

  source = ReplicaGradients(graphdef, algorithm, mesh, loss_and_grads, accumulation_steps)
  source.name, source.stage_paths = "skippipe", np.asarray(stage_paths)
  return source


class PipelineGradients:
  """The pipeline executor on the (replica, stage) grid; state in grid layout [R, S, ...]."""

  name = "pipeline"

  def __init__(self, model_cfg, algorithm, mesh, pipeline_cfg, seed: int):
    from lowcomm_jax.parallel import executor, routing, stages, ticks  # pylint: disable=g-import-not-at-top
    self.algorithm, self.mesh, self.stages = algorithm, mesh, stages
    self.num_stages, r, k = (
      pipeline_cfg.num_stages,
      algorithm.num_replicas,
      pipeline_cfg.slots_per_step,
    )
    self.slots = k
    if pipeline_cfg.routing == "fixed":
      pool = [routing.full_pipeline_routes(k, self.num_stages, r)]
    else:  # a pool of random routings, step t runs entry (t − 1) mod pool (one program each)
      pool = [routing.random_routes(k, self.num_stages, r, pipeline_cfg.routing_seed,
                                    first_slot=e * k)
              for e in range(pipeline_cfg.num_routings)]
    self.tables = [
      ticks.compile_ticks(routes, self.num_stages, r, pipeline_cfg.order) for routes in pool
    ]
    fns = stages.StageFunctions(model_cfg)
    self.executors = [executor.PipelineExecutor(fns, t, mesh) for t in self.tables]

  def route_at(self, step: int) -> int:
    return (step - 1) % len(self.tables)

  def comm_events(self, num_steps: int, entries_at) -> list:
    """Every tick's stage-to-stage message of step s (1-based), as a blocking point-to-point `send`
    (ℓ + 8S/B) issued at clock step s − 1 and needed by step s: a tick waits for the message the
    previous tick sent, so a step's transfers add to its compute, one after the other (sends of
    one tick on different devices run in parallel; activations and gradients of one tick are two).
    `entries_at(step)` is the ledger of step `step`'s program: the source's own entries are those
    of no plan (`Entry.plan` None); a permute traced once stands for the `repeats` ticks that share
    its pattern."""
    from lowcomm_jax.sim import clock  # pylint: disable=g-import-not-at-top
    return [clock.CommEvent(step - 1, step, e.payload_bytes, "send", 2)
            for step in range(1, num_steps + 1) for e in entries_at(step)
            if e.plan is None for _ in range(e.repeats)]

  def per_device(self, fn, num_in):
    grid = P(mesh_lib.REPLICA, mesh_lib.STAGE)
    squeeze = lambda t: jax.tree.map(lambda x: x[0, 0], t)
    expand = lambda t: jax.tree.map(lambda x: x[None, None], t)
    return lambda *args: jax.shard_map(
        lambda *args: expand(fn(*map(squeeze, args))), mesh=mesh_lib.current(self.mesh),
        in_specs=(grid,) * num_in, out_specs=grid, check_vma=False)(*args)

  def init(self, params):
    r = self.algorithm.num_replicas
    grid = self.stages.to_grid(jax.tree.map(lambda x: jnp.broadcast_to(x, (r,) + x.shape), params),
                               self.num_stages)
    return grid, self.per_device(self.algorithm.init, 1)(grid)

  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())  # every device reads its micro-batches' tokens

  def state_shardings(self, abstract_state, param_specs, abstract_params):
    """Grid layout: every leaf [R, S, ...] holds one slice per device, the step count is shared."""
    grid = NamedSharding(self.mesh, P(mesh_lib.REPLICA, mesh_lib.STAGE))
    return TrainState(jax.tree.map(lambda _: grid, abstract_state.params),
                               jax.tree.map(lambda _: grid, abstract_state.opt_state),
                               NamedSharding(self.mesh, P()))

  def replica_params(self, grid):
    return self.stages.from_grid(grid)

  def opt_state_view(self, opt_state):
    """The grid state as `algorithm.eval_params` expects it: shared leaves taken at replica 0."""
    return jax.tree.map(lambda axis, x: jax.tree.map(lambda y: y[0], x) if axis is None else x,
                        self.algorithm.state_axes, opt_state, is_leaf=lambda a: a is None)

  def eval_params(self, state):
    params_s = self.algorithm.eval_params(state.params, self.opt_state_view(state.opt_state))
    return jax.tree.map(lambda x: x[0],
                        self.stages.from_grid(jax.tree.map(lambda x: x[None], params_s)))

  def train_step(self, phase, route):
    run = self.executors[route].grads_fn  # its comm.permute calls record the pipeline's bytes
    r, k = self.algorithm.num_replicas, self.slots
    update = self.per_device(lambda g, s, p: self.algorithm.update(g, s, p, phase), 3)

    def train_step(state: TrainState, batch_r):
      # Micro-batch m = slot·R + replica, drawn from its origin replica's own batch.
      b, t1 = batch_r.shape[1] // k, batch_r.shape[2]
      batch_m = batch_r.reshape(r, k, b, t1).swapaxes(0, 1).reshape(k * r, b, t1)
      loss_rs, grads, _ = run(state.params, batch_m)
      updates, opt_state = update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      grad_norm_r = jnp.sqrt(
        sum(jnp.sum(g.reshape(r, -1) ** 2, axis=1) for g in jax.tree.leaves(grads))
      )
      return (TrainState(params, opt_state, state.step + 1),
              {"loss": loss_rs.reshape(r, -1).sum(1), "grad_norm": grad_norm_r})

    return train_step


def stage_paths_of(config) -> np.ndarray:
  """SkipPipe's per-micro-batch stage paths: `skippipe.paths`, or planned by the SkipPipe scheduler
  on `skippipe.topology` (placement by `skippipe.placement_seed`, paths of
  `skippipe.path_length`)."""
  from lowcomm_jax.skippipe import paths, placement, scheduler, topology, training  # pylint: disable=g-import-not-at-top
  s = config.skippipe
  if s.paths:
    return training.check_stage_paths(parse_paths(s.paths), config.pipeline.num_stages)
  topo = topology.PRESETS[s.topology]()
  placed = placement.optimize_placement(topo, seed=s.placement_seed)
  skip = paths.SkipConfig(path_length=s.path_length,
                          microbatches_per_data_node=s.microbatches_per_data_node)
  planned = training.check_stage_paths(
    scheduler.skippipe_schedule(topo, placed, skip).stage_paths(), config.pipeline.num_stages
  )
  accumulation = config.optimizer.accumulation_steps
  if config.data.batch_size % (len(planned) * accumulation):
    raise ValueError(
      f"data.batch_size must be a multiple of the {len(planned)} micro-batches the "
      f"SkipPipe schedule plans on {s.topology}"
      + (f" times optimizer.accumulation_steps={accumulation}" if accumulation > 1 else "")
      + f", got {config.data.batch_size}"
    )
  return planned


def _replicas(config, graphdef, model_cfg, algorithm, mesh):
  return ReplicaGradients(graphdef, algorithm, mesh,
                          accumulation_steps=config.optimizer.accumulation_steps)


def _check_replicas(c) -> None:
  checks.require(c.mesh.stage == 1, "mesh.stage", "1 unless gradients=pipeline (only the pipeline "
                 "runs stages on devices; other axes would compute every step again)", c.mesh.stage)


def _skippipe(config, graphdef, model_cfg, algorithm, mesh):
  return skippipe_gradients(graphdef, algorithm, mesh, stage_paths_of(config),
                            config.pipeline.layers_per_stage, config.optimizer.accumulation_steps)


def _check_one_fragment(c) -> None:
  checks.require(c.outer.num_fragments == 1, "outer.num_fragments",
                 f"1 with gradients={c.gradients} (fragments are cut by layer, stages too)",
                 c.outer.num_fragments)


def _check_skippipe(c) -> None:
  from lowcomm_jax.skippipe import topology, training  # pylint: disable=g-import-not-at-top
  _check_one_fragment(c)
  checks.require(c.mesh.stage == 1, "mesh.stage",
                 "1 with gradients=skippipe (paths run on one device "
                 "group; gradients=pipeline runs stages on devices)", c.mesh.stage)
  if not c.skippipe.paths:
    stages = len(topology.PRESETS[c.skippipe.topology]().stage_sizes)
    checks.integer(c, "skippipe.path_length", 1, stages + 1,
                   f" (stages per path counting stage 0; {c.skippipe.topology} has {stages} "
                   f"stages)")
    return
  try:
    paths = training.check_stage_paths(parse_paths(c.skippipe.paths), c.pipeline.num_stages)
  except ValueError as error:
    raise ValueError(f"skippipe.paths={c.skippipe.paths!r} with pipeline.num_stages="
                     f"{c.pipeline.num_stages}: {error}") from None
  checks.require(c.data.batch_size % len(paths) == 0, "data.batch_size",
                 f"a multiple of the {len(paths)} skippipe.paths (one micro-batch each)",
                 c.data.batch_size)
  checks.require(c.data.batch_size // c.optimizer.accumulation_steps % len(paths) == 0,
                 "optimizer.accumulation_steps",
                 f"a divisor of data.batch_size={c.data.batch_size} that leaves a multiple of the "
                 f"{len(paths)} skippipe.paths in each micro-batch", c.optimizer.accumulation_steps)


def _pipeline(config, graphdef, model_cfg, algorithm, mesh):
  return PipelineGradients(model_cfg, algorithm, mesh, config.pipeline, config.seed)


def _check_pipeline(c) -> None:
  p = c.pipeline
  _check_one_fragment(c)
  checks.require(c.optimizer.accumulation_steps == 1, "optimizer.accumulation_steps",
                 "1 with gradients=pipeline (its batches are split into micro-batches by "
                 "pipeline.slots_per_step)", c.optimizer.accumulation_steps)
  checks.require(p.slots_per_step >= 1 and c.data.batch_size % p.slots_per_step == 0,
                 "pipeline.slots_per_step",
                 f">= 1 and a divisor of data.batch_size={c.data.batch_size}",
                 p.slots_per_step)
  checks.require(c.mesh.stage == p.num_stages, "mesh.stage",
                 f"pipeline.num_stages={p.num_stages} with gradients=pipeline", c.mesh.stage)
  checks.require(c.mesh.replica == c.num_replicas, "mesh.replica",
                 f"num_replicas={c.num_replicas} with gradients=pipeline (one replica per stage "
                 f"row)",
                 c.mesh.replica)
  checks.require(c.mesh.data == 1 and c.mesh.tensor == 1, "mesh.data and mesh.tensor",
                 "1 with gradients=pipeline", (c.mesh.data, c.mesh.tensor))


def check_every_section(c) -> None:
  """The `pipeline` and `skippipe` values that are wrong whatever the gradient source."""
  from lowcomm_jax.parallel import ticks  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.skippipe import topology  # pylint: disable=g-import-not-at-top
  p = c.pipeline
  checks.integer(c, "pipeline.num_stages", 1)
  checks.integer(c, "pipeline.layers_per_stage", 1)
  checks.require(p.routing in ("random", "fixed"), "pipeline.routing", "random or fixed", p.routing)
  checks.require(p.order in ticks.ORDERS, "pipeline.order", f"one of {ticks.ORDERS}", p.order)
  checks.integer(c, "pipeline.slots_per_step", 1)
  checks.integer(c, "pipeline.num_routings", 1)
  checks.integer(c, "pipeline.routing_seed", 0, 2**32, " (it seeds the random routings)")
  presets = tuple(topology.PRESETS)
  checks.require(c.skippipe.topology in presets, "skippipe.topology",
                 f"a preset of lowcomm_jax.skippipe.topology: one of {presets}",
                 c.skippipe.topology)
  checks.integer(c, "skippipe.path_length", 1, note=" (stages per path counting stage 0)")
  checks.integer(c, "skippipe.microbatches_per_data_node", 1)
  checks.integer(c, "skippipe.placement_seed", 0, 2**32, " (it seeds the placement search)")


class Source(NamedTuple):
  """One value of the config's `gradients`."""

  # (config, graphdef, model config, algorithm, mesh) -> the source the loop steps through
  build: Callable[..., Any]
  # config -> None; one ValueError naming the option and its allowed values, before any compute
  check_config: Callable[[ml_collections.ConfigDict], None]


SOURCES = {
    "replicas": Source(_replicas, _check_replicas),
    "skippipe": Source(_skippipe, _check_skippipe),
    "pipeline": Source(_pipeline, _check_pipeline),
}
GRADIENTS = tuple(SOURCES)


def make_source(config, graphdef, model_cfg, algorithm, mesh):
  """The gradient source `config.gradients` names."""
  return SOURCES[config.gradients].build(config, graphdef, model_cfg, algorithm, mesh)
