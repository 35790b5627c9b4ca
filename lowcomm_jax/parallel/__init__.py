"""Pipeline parallelism over a (replica, stage) mesh: SkipPipe schedules and NoLoCo's random
routing.

Training with the pipeline inside each step is `config.gradients = "pipeline"` of the one Trainer
(`lowcomm_jax.train.sources.PipelineGradients`).

Modules, one concept each:
  routing    routes through the grid: full pipeline, SkipPipe paths, NoLoCo's random routing
  ticks      a schedule compiled into ticks (op, micro-batch, destination per device), validated
  stages     the decoder cut into stages, the grid parameter layout, the sequential reference
  executor   runs a tick table with `jax.shard_map`, one `lax.ppermute` per direction per tick
  bubble     busy/idle ticks: planned, measured, and the SkipPipe simulator's prediction
  plots      a tick table drawn as a grid
"""

from lowcomm_jax.parallel import bubble, executor, routing, stages, ticks
from lowcomm_jax.parallel.executor import PipelineExecutor, PipelineResult
from lowcomm_jax.parallel.routing import Route
from lowcomm_jax.parallel.ticks import TickTable, compile_ticks

__all__ = [
  "PipelineExecutor",
  "PipelineResult",
  "Route",
  "TickTable",
  "bubble",
  "compile_ticks",
  "executor",
  "routing",
  "stages",
  "ticks",
]
