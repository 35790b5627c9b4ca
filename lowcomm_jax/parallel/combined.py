"""NoLoCo or DiLoCo across the `replica` axis with a pipeline inside every step (NoLoCo's DP × PP grid).

Each of the S·R devices holds stage s of replica r (grid layout, `stages.py`). A training step is
(1) the pipeline executor over the batch's micro-batches — routed at random between the replicas of
consecutive stages (docs/algorithms.md §2.2), or fixed — giving each device the gradient of its stage slice,
then (2) the optimizer under `jax.shard_map` over (replica, stage): the inner step is local, and the
outer step's collectives run over the axis name "replica", which inside this shard_map pairs or
averages the replicas *of the same stage*, exactly as NoLoCo's per-stage process groups do. NoLoCo
(`lowcomm_jax.optim.noloco.NoLoCo`) gossips in random pairs every H steps with no all-reduce; DiLoCo
(`lowcomm_jax.optim.streaming.diloco`) all-reduces the outer gradient every H steps. The same
optimizer objects as the data-parallel code, unchanged.

Static transfers need the routing at compile time, so random routing draws a pool of
`num_routings` batch routings from the seed (slot counter k running over the pool) and step t uses
entry t mod pool: one compiled executor per entry. The reference draws a fresh permutation for
every sample; here routings repeat every `num_routings` steps. Evaluation uses fixed routing: the
loss of each replica's own model (replica r at every stage), averaged over replicas.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax.models import get_model_config, llama
from lowcomm_jax.optim.noloco import noloco, weight_spread
from lowcomm_jax.optim.outer import outer_nesterov
from lowcomm_jax.optim.streaming import diloco
from lowcomm_jax.parallel import routing, stages, ticks
from lowcomm_jax.parallel.executor import GRID, PipelineExecutor

ALGORITHMS = ("noloco", "diloco")
ROUTINGS = ("random", "fixed")


def default_config() -> ml_collections.ConfigDict:
  """Every key of a pipeline run, with its default (sized for 8 fake CPU devices, a few minutes)."""
  c = ml_collections.ConfigDict()
  c.algorithm = "noloco"  # "noloco" (gossip in pairs) or "diloco" (all-reduce) across replicas
  c.num_stages = 2  # S: pipeline stages (mesh axis `stage`)
  c.num_replicas = 4  # R: copies of each stage (mesh axis `replica`)
  c.num_steps = 200
  c.seed = 0
  c.model = ml_collections.ConfigDict(dict(size="tiny", layers_per_stage=1))
  c.data = ml_collections.ConfigDict(dict(corpus="stdlib", seq_len=64, microbatch_size=4))
  c.pipeline = ml_collections.ConfigDict(dict(
      routing="random",  # "random" (NoLoCo's routing) or "fixed" (replica r -> replica r)
      order="gpipe",  # tick order: "gpipe" or "1f1b"
      slots_per_step=2,  # K: micro-batches each replica starts per step
      num_routings=4,  # distinct random routings compiled (step t uses t mod this)
      routing_seed=0))
  c.optimizer = ml_collections.ConfigDict(dict(learning_rate=3e-3, warmup_steps=20, b1=0.9, b2=0.95,
                                               min_lr_ratio=0.1))
  c.noloco = ml_collections.ConfigDict(dict(sync_every=50, group_size=2, momentum=0.5,
                                            learning_rate=0.7, gamma=0.7, num_groupings=4))
  c.diloco = ml_collections.ConfigDict(dict(sync_every=100, outer_learning_rate=0.7,
                                            outer_momentum=0.3))
  c.eval = ml_collections.ConfigDict(dict(every=50, batch_size=8, num_batches=4))
  return c


def validate_config(c) -> None:
  """One ValueError naming the option and what is allowed."""
  if c.algorithm not in ALGORITHMS:
    raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {c.algorithm!r}")
  if c.pipeline.routing not in ROUTINGS:
    raise ValueError(f"pipeline.routing must be one of {list(ROUTINGS)}, got {c.pipeline.routing!r}")
  if c.pipeline.order not in ticks.ORDERS:
    raise ValueError(f"pipeline.order must be one of {list(ticks.ORDERS)}, got {c.pipeline.order!r}")
  for name in ("num_stages", "num_replicas", "num_steps"):
    if int(c[name]) < 1:
      raise ValueError(f"{name} must be >= 1, got {c[name]}")
  for name in ("slots_per_step", "num_routings"):
    if int(c.pipeline[name]) < 1:
      raise ValueError(f"pipeline.{name} must be >= 1, got {c.pipeline[name]}")
  if c.num_stages * c.num_replicas > jax.device_count():
    raise ValueError(f"num_stages × num_replicas = {c.num_stages * c.num_replicas} devices needed, "
                     f"{jax.device_count()} available")
  if c.algorithm == "noloco" and c.num_replicas % c.noloco.group_size:
    raise ValueError(f"noloco.group_size must divide num_replicas={c.num_replicas}, got "
                     f"{c.noloco.group_size}")


def make_optimizer(c):
  """The replica-axis optimizer of the config: NoLoCo or DiLoCo around an Adam inner optimizer."""
  o = c.optimizer
  warmup = min(o.warmup_steps, c.num_steps - 1)
  lr = optax.warmup_cosine_decay_schedule(0.0 if warmup else o.learning_rate, o.learning_rate,
                                          warmup, max(c.num_steps, warmup + 1),
                                          o.learning_rate * o.min_lr_ratio)
  inner = optax.adam(lr, b1=o.b1, b2=o.b2)  # NoLoCo's inner optimizer: Adam, no weight decay
  if c.algorithm == "noloco":
    n = c.noloco
    return noloco(inner, c.num_replicas, n.sync_every, n.group_size, n.momentum, n.learning_rate,
                  n.gamma, seed=c.seed, num_groupings=n.num_groupings)
  d = c.diloco
  return diloco(inner, outer_nesterov(d.outer_learning_rate, d.outer_momentum), d.sync_every)


class GridOptimizer:
  """A replica-axis optimizer (NoLoCo, DiLoCo) run per device on grid-layout trees.

  Every leaf of the parameters and of the optimizer state carries the leading [R, S] axes; one
  compiled program per phase of the optimizer (a non-sync step has no collective at all).
  """

  def __init__(self, tx, mesh):
    self.tx, self.mesh = tx, mesh
    self._steps: dict = {}

  def _shard(self, fn, num_in):
    squeeze = lambda t: jax.tree.map(lambda x: x[0, 0], t)
    expand = lambda t: jax.tree.map(lambda x: x[None, None], t)
    body = lambda *args: expand(fn(*map(squeeze, args)))
    return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(GRID,) * num_in, out_specs=GRID,
                                 check_vma=False))

  def init(self, grid_params):
    return self._shard(self.tx.init, 1)(grid_params)

  def step(self, step: int, grads, state, grid_params):
    """Inner step `step` (1-based): the phase is read on the host, as the Trainer does."""
    phase = self.tx.phase_at(step)
    if phase not in self._steps:
      def update(g, s, p, phase=phase):
        updates, s = self.tx.update(g, s, p, phase=phase)
        return optax.apply_updates(p, updates), s
      self._steps[phase] = self._shard(update, 3)
    return self._steps[phase](grads, state, grid_params)


def batch_routes(c, entry: int) -> list[routing.Route]:
  """Routing pool entry `entry`: K slots × R micro-batches (m = k·R + r)."""
  k, s, r = c.pipeline.slots_per_step, c.num_stages, c.num_replicas
  if c.pipeline.routing == "fixed":
    return routing.full_pipeline_routes(k, s, r)
  return routing.random_routes(k, s, r, c.pipeline.routing_seed, first_slot=entry * k)


@dataclasses.dataclass
class RunResult:
  metrics: list  # one dict per logged step
  summary: dict
  params_R: object  # final model parameters of every replica, leaves [R, ...]


def train(c, log: Callable[[str], None] = print, on_metrics: Callable[[dict], None] | None = None
          ) -> RunResult:
  """Trains a fresh model on the grid: pipeline step + replica optimizer, `c.num_steps` times."""
  from lowcomm_jax.data import pipeline as data_lib  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.skippipe import training  # pylint: disable=g-import-not-at-top

  validate_config(c)
  s, r, k = c.num_stages, c.num_replicas, c.pipeline.slots_per_step
  cfg = get_model_config(c.model.size, num_layers=s * c.model.layers_per_stage)
  graphdef = nnx.split(nnx.eval_shape(lambda: llama.Decoder(cfg, nnx.Rngs(c.seed))), nnx.Param)[0]
  params = llama.init_params(cfg, c.seed)
  params_R = jax.tree.map(lambda x: jnp.broadcast_to(x, (r,) + x.shape), params)
  mesh = mesh_lib.make_mesh({mesh_lib.REPLICA: r, mesh_lib.STAGE: s})
  fns = stages.StageFunctions(cfg)
  pool = [PipelineExecutor(fns, ticks.compile_ticks(batch_routes(c, e), s, r, c.pipeline.order),
                           mesh)
          for e in range(1 if c.pipeline.routing == "fixed" else c.pipeline.num_routings)]
  opt = GridOptimizer(make_optimizer(c), mesh)
  grid = stages.to_grid(params_R, s)
  state = opt.init(grid)
  splits = data_lib.load_splits(c.data.corpus)
  shards = [data_lib.train_dataset(splits.train, c.data.seq_len, k * c.data.microbatch_size, c.seed,
                                   shard_index=i, num_shards=r) for i in range(r)]
  evals = data_lib.eval_batches(splits.eval, c.data.seq_len, c.eval.batch_size, c.eval.num_batches)
  tokens_per_step = r * k * c.data.microbatch_size * c.data.seq_len
  metrics, started, compile_s = [], time.perf_counter(), 0.0

  def evaluate(replicas):
    return [training.evaluate(graphdef, jax.tree.map(lambda x, i=i: x[i], replicas), evals)
            for i in range(r)]

  for step in range(1, c.num_steps + 1):
    # Micro-batch m = slot·R + replica, drawn from its origin replica's own shard.
    per_replica = [np.asarray(ds[step - 1]).reshape(k, c.data.microbatch_size, -1) for ds in shards]
    batch = np.stack(per_replica, axis=1).reshape(k * r, c.data.microbatch_size, -1)
    result = pool[(step - 1) % len(pool)](grid, batch)
    grid, state = opt.step(step, result.grads, state, grid)
    if step == 1:
      jax.block_until_ready(grid)
      compile_s = time.perf_counter() - started
    row = {"step": step, "tokens": step * tokens_per_step, "loss": float(result.loss) / r,
           "wall_s": time.perf_counter() - started}
    if step % c.eval.every == 0 or step == c.num_steps:
      replicas = stages.from_grid(grid)
      losses = evaluate(replicas)
      row.update(eval_loss=float(np.mean(losses)), eval_loss_per_replica=losses,
                 weight_spread=float(weight_spread(replicas)))
      log(f"step {step:4d}  loss {row['loss']:.4f}  eval {row['eval_loss']:.4f}  "
          f"spread {row['weight_spread']:.2e}")
    metrics.append(row)
    if on_metrics is not None:
      on_metrics(row)
  seconds = time.perf_counter() - started
  final = metrics[-1]
  table = pool[0].table
  summary = {
      "algorithm": c.algorithm, "routing": c.pipeline.routing, "order": c.pipeline.order,
      "num_stages": s, "num_replicas": r, "steps": c.num_steps, "tokens": c.num_steps * tokens_per_step,
      "final_eval_loss": final["eval_loss"], "final_eval_loss_per_replica": final["eval_loss_per_replica"],
      "final_weight_spread": final["weight_spread"], "ticks_per_step": table.num_ticks,
      "bubble_fraction": table.bubble_fraction(), "compiled_routings": len(pool),
      "wall_seconds": seconds, "first_step_seconds": compile_s,
  }
  return RunResult(metrics, summary, stages.from_grid(grid))
