"""Training and evaluation along SkipPipe paths (docs/algorithms.md §3.4).

Every micro-batch of a batch runs the embedding, then the layer blocks of the
stages on its path in path order (stage 0 first; a swap runs the two stages'
blocks swapped, each block's own layers in order), then the final norm, head
and loss. The loss of each micro-batch is divided by the number of
micro-batches and the gradients are summed over micro-batches, so a layer on
no micro-batch's path gets no update from the data (AdamW's weight decay, if
any, still applies). Then the optimizer steps (the reference: clip to 1.0, AdamW).

Paths of one length form an int array [num_microbatches, path_length] of
stage ids. The jitted step takes it as a traced argument, so one compiled
program serves every iteration whatever the scheduler plans; only a new
path length compiles again. The full pipeline is the path (0, 1, ..., S-1)
for every micro-batch, through the same code.

A run trains through the one Trainer with `config.gradients = "skippipe"` (`train.sources`, whose
loss is `summed_microbatch_grads`); the pieces below also serve a hand-written loop::

  tx = lowcomm_jax.optim.inner.make_optimizer(config.optimizer, num_steps)
  graphdef, state = init_state(cfg, tx, seed=0)
  step = make_path_train_step(graphdef, tx, num_stages=6, layers_per_stage=1)
  state, metrics = step(state, batch_MxBxT1, schedule.stage_paths())
  loss = evaluate(graphdef, state.params, eval_NxBxT1, layers_per_stage=1)
  removed = stage_removal_losses(graphdef, state.params, eval_NxBxT1, 6, 1, num_removed=3)
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowcomm_jax.models import llama
from lowcomm_jax.models.config import ModelConfig
from lowcomm_jax.models.loss import lm_loss
from lowcomm_jax.optim.inner import TrainState


def check_stage_paths(stage_paths, num_stages: int,
                      num_microbatches: int | None = None) -> np.ndarray:
  """Validates per-micro-batch stage paths and returns them as int32 [M, k].

  Args:
    stage_paths: a sequence of 1-D stage-id sequences (for example
      `Schedule.stage_paths()`) or an int array [M, k].
    num_stages: S; stage ids must lie in [0, S).
    num_microbatches: if given, the number of paths the batch needs.

  Returns:
    int32 array [M, k].

  Raises:
    ValueError: paths of different lengths, an empty path, a stage id out of
      range, a path not starting at stage 0, a stage visited twice, or a
      count of paths that does not match the micro-batches.
  """
  if num_stages < 1:
    raise ValueError(f"num_stages: must be >= 1, got {num_stages}")
  if isinstance(stage_paths, jax.core.Tracer):
    raise ValueError("stage_paths: must be concrete here; call the jitted step (step.jitted) "
                     "to pass traced paths, which are not checked")
  rows = [np.asarray(p).reshape(-1) for p in stage_paths]
  if not rows:
    raise ValueError("stage_paths: need at least one path")
  lengths = sorted({len(r) for r in rows})
  if len(lengths) != 1:
    raise ValueError(f"stage_paths: all paths of one batch must have the same length (one "
                     f"compiled program), got lengths {lengths}")
  if lengths[0] == 0:
    raise ValueError("stage_paths: a path must visit at least stage 0, got empty paths")
  paths = np.stack(rows)
  if not np.issubdtype(paths.dtype, np.integer):
    raise ValueError(f"stage_paths: stage ids must be integers, got dtype {paths.dtype}")
  for i, path in enumerate(paths):
    bad = [int(s) for s in path if not 0 <= s < num_stages]
    if bad:
      raise ValueError(f"stage_paths: micro-batch {i} visits stage {bad[0]}, outside "
                       f"[0, num_stages={num_stages}); path {path.tolist()}")
    if path[0] != 0:
      raise ValueError(f"stage_paths: micro-batch {i} starts at stage {int(path[0])}; every path "
                       f"must start at stage 0 (embedding and loss live there); "
                       f"path {path.tolist()}")
    if len(set(path.tolist())) != len(path):
      raise ValueError(f"stage_paths: micro-batch {i} visits a stage twice; path {path.tolist()}")
  if num_microbatches is not None and len(paths) != num_microbatches:
    raise ValueError(f"stage_paths: got {len(paths)} paths for a batch of {num_microbatches} "
                     "micro-batches; give one path per micro-batch")
  return paths.astype(np.int32)


def layer_order(stage_paths_MxK, layers_per_stage: int):
  """Layer indices [M, k * layers_per_stage] each micro-batch runs, in order.

  Stage s owns layers [s * layers_per_stage, (s + 1) * layers_per_stage);
  its block runs in its own order wherever the stage sits on the path. Works
  on numpy and on traced jax arrays (no value checks here).
  """
  xp = jnp if isinstance(stage_paths_MxK, jax.Array) else np
  paths = xp.asarray(stage_paths_MxK)
  layers = paths[..., None] * layers_per_stage + xp.arange(layers_per_stage)
  return layers.reshape(*paths.shape[:-1], paths.shape[-1] * layers_per_stage)


def full_stage_paths(num_stages: int, num_microbatches: int) -> np.ndarray:
  """Every micro-batch through every stage in order: the full pipeline, int32 [M, S]."""
  return np.tile(np.arange(num_stages, dtype=np.int32), (num_microbatches, 1))


def num_model_layers(params) -> int:
  """Stacked blocks in a pure-dict parameter tree."""
  return int(jax.tree.leaves(params["blocks"])[0].shape[0])


def _check_layers(params, num_stages: int, layers_per_stage: int) -> None:
  layers = num_model_layers(params)
  if layers_per_stage < 1 or num_stages * layers_per_stage != layers:
    raise ValueError(f"layers_per_stage: num_stages ({num_stages}) x layers_per_stage "
                     f"({layers_per_stage}) must equal the model's num_layers ({layers})")


def summed_microbatch_grads(graphdef, params, batch_MxBxT1, layer_paths_MxL):
  """Loss and gradient of one batch, accumulated micro-batch by micro-batch.

  Each micro-batch's loss is its mean token cross-entropy along its own path,
  divided by M; the gradients of these terms are summed in a scan, so only
  one micro-batch's activations are alive at a time (as on a pipeline node).

  Args:
    graphdef: the Decoder's graph definition.
    params: pure-dict parameters.
    batch_MxBxT1: int tokens [M, B, T + 1].
    layer_paths_MxL: int layer indices [M, L] (see `layer_order`).

  Returns:
    (loss, grads, per-micro-batch losses [M]); loss is the mean over
    micro-batches of their path losses.
  """
  num_mb = batch_MxBxT1.shape[0]
  value_and_grad = jax.value_and_grad(
      lambda p, mb, path: lm_loss(graphdef, p, mb, path=path) / num_mb)

  def accumulate(grad_sum, inputs):
    mb, path = inputs
    loss, grads = value_and_grad(params, mb, path)
    return jax.tree.map(jnp.add, grad_sum, grads), loss

  zeros = jax.tree.map(jnp.zeros_like, params)
  grads, losses = jax.lax.scan(accumulate, zeros, (batch_MxBxT1, layer_paths_MxL))
  return losses.sum(), grads, losses * num_mb


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation,
               seed: int = 0) -> tuple[nnx.GraphDef, TrainState]:
  """A fresh Decoder's graphdef and its training state (pure-dict params)."""
  graphdef = nnx.split(nnx.eval_shape(lambda: llama.Decoder(cfg, nnx.Rngs(seed))), nnx.Param)[0]
  params = llama.init_params(cfg, seed)
  return graphdef, TrainState(params, jax.jit(tx.init)(params), jnp.zeros((), jnp.int32))


def make_path_train_step(graphdef, tx: optax.GradientTransformation, num_stages: int,
                         layers_per_stage: int) -> Callable:
  """(state, batch [M, B, T+1], stage_paths [M, k]) -> (state, metrics).

  The returned function checks the paths (and the stage split against the
  model) on the host and calls a jitted step in which the paths are a traced
  int array; `step.jitted` is that inner step, for callers that pass
  already-checked paths. Metrics: "loss" (mean path loss), "mb_losses" [M],
  "grad_norm" (before clipping).
  """

  def core(state: TrainState, batch_MxBxT1, stage_paths_MxK):
    layer_paths = layer_order(stage_paths_MxK, layers_per_stage)
    loss, grads, mb_losses = summed_microbatch_grads(graphdef, state.params, batch_MxBxT1,
                                                     layer_paths)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "mb_losses": mb_losses, "grad_norm": optax.tree.norm(grads)}
    return TrainState(params, opt_state, state.step + 1), metrics

  jitted = jax.jit(core, donate_argnums=(0,))
  checked_layers = []

  def step(state: TrainState, batch_MxBxT1, stage_paths):
    if not checked_layers:
      _check_layers(state.params, num_stages, layers_per_stage)
      checked_layers.append(True)
    if np.ndim(batch_MxBxT1) != 3:
      raise ValueError(f"batch: expected int tokens [num_microbatches, B, T + 1], got shape "
                       f"{np.shape(batch_MxBxT1)}")
    paths = check_stage_paths(stage_paths, num_stages, num_microbatches=np.shape(batch_MxBxT1)[0])
    return jitted(state, batch_MxBxT1, paths)

  step.jitted = jitted
  return step


def kept_stage_path(keep_stages: Sequence[int], num_stages: int) -> np.ndarray:
  """Stage path int32 [k] running only `keep_stages` (must include 0), in stage order."""
  kept = sorted(set(int(s) for s in keep_stages))
  if 0 not in kept:
    raise ValueError(f"keep_stages: must include stage 0 (embedding and head), got {kept}")
  return check_stage_paths([kept], num_stages)[0]


def evaluate(graphdef, params, batches_NxBxT1, layers_per_stage: int = 1,
             stage_path=None) -> float:
  """Mean loss over eval batches [N, B, T + 1], with all layers in order or along one stage path.

  Args:
    graphdef: the Decoder's graph definition.
    params: pure-dict parameters.
    batches_NxBxT1: int tokens [N, B, T + 1].
    layers_per_stage: layers each stage holds (used with `stage_path`).
    stage_path: None for every layer in order (validation as in the paper),
      or stage ids starting with 0 (for example `kept_stage_path`).
  """
  if stage_path is None:
    path = None
  else:
    num_layers = num_model_layers(params)
    if layers_per_stage < 1 or num_layers % layers_per_stage:
      raise ValueError(f"layers_per_stage: must divide the model's num_layers ({num_layers}), "
                       f"got {layers_per_stage}")
    checked = check_stage_paths([stage_path], num_layers // layers_per_stage)
    path = layer_order(checked, layers_per_stage)[0]
  return float(_eval_loss(graphdef, params, jnp.asarray(batches_NxBxT1),
                          None if path is None else jnp.asarray(path)))


@functools.partial(jax.jit, static_argnums=0)
def _eval_loss(graphdef, params, batches_NxBxT1, path):
  losses = jax.lax.map(lambda b: lm_loss(graphdef, params, b, path=path), batches_NxBxT1)
  return losses.mean()


def stage_removal_losses(graphdef, params, batches_NxBxT1, num_stages: int, layers_per_stage: int,
                         num_removed: int) -> dict[tuple[int, ...], float]:
  """Eval loss with every choice of `num_removed` non-zero stages taken out (the half-model test).

  Returns:
    {kept stages: mean eval loss}, over all subsets that keep stage 0 and
    num_stages - 1 - num_removed of the others, the kept stages run in order.
  """
  if not 0 <= num_removed <= num_stages - 1:
    raise ValueError(f"num_removed: must be in [0, num_stages - 1 = {num_stages - 1}], "
                     f"got {num_removed}")
  _check_layers(params, num_stages, layers_per_stage)
  out = {}
  for rest in itertools.combinations(range(1, num_stages), num_stages - 1 - num_removed):
    kept = (0,) + rest
    out[kept] = evaluate(graphdef, params, batches_NxBxT1, layers_per_stage,
                         kept_stage_path(kept, num_stages))
  return out
