"""The decoder cut into pipeline stages, its parameters laid out on the (replica, stage) grid, and
the sequential reference a pipeline must equal.

Stage s holds layers [s·l, (s+1)·l) (l = layers per stage). Stage 0 also holds the embedding, the
final norm and the head: a micro-batch starts there and its loss is computed there (SkipPipe's
convention, docs/algorithms.md §3.1). The functions a device runs:

  embed(outer, tokens) → x;   layers(blocks_l, x) → x;   head_loss(outer, x, targets) → loss

Grid layout: every parameter leaf gets two leading axes [R, S, ...] (replica, stage), sharded
P("replica", "stage") so a device holds exactly its stage's slice. The blocks [L, ...] of replica r
become [S, l, ...]; the embedding, final norm and head sit in stage slot 0 and the other slots hold
zeros (they get zero gradients and stay zero under Adam, NoLoCo and DiLoCo alike), which keeps one
sharding for every leaf and no collective over `stage` for the non-block parameters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowcomm_jax.models import llama
from lowcomm_jax.models.config import ModelConfig
from lowcomm_jax.models.loss import cross_entropy, lm_loss
from lowcomm_jax.parallel.routing import Route

NON_BLOCK = ("embed", "final_norm", "head")


def num_layers(params) -> int:
  return int(jax.tree.leaves(params["blocks"])[0].shape[0])


def check_split(params, num_stages: int) -> int:
  """Layers per stage, or a ValueError when the model's layers do not split into `num_stages`."""
  layers = num_layers(params)
  if num_stages < 1 or layers % num_stages:
    raise ValueError(f"num_stages: must divide the model's num_layers ({layers}), got {num_stages}")
  return layers // num_stages


def to_grid(params_R, num_stages: int):
  """Model parameters of R replicas (leaves [R, ...]) → grid layout (leaves [R, S, ...])."""
  lps = check_split(jax.tree.map(lambda x: x[0], params_R), num_stages)
  out = {"blocks": jax.tree.map(lambda x: x.reshape((x.shape[0], num_stages, lps) + x.shape[2:]),
                                params_R["blocks"])}
  for name in NON_BLOCK:
    out[name] = jax.tree.map(
        lambda x: jnp.zeros((x.shape[0], num_stages) + x.shape[1:], x.dtype).at[:, 0].set(x),
        params_R[name])
  return out


def from_grid(grid):
  """Grid layout (leaves [R, S, ...]) → model parameters of R replicas (leaves [R, ...])."""
  out = {"blocks": jax.tree.map(lambda x: x.reshape((x.shape[0], -1) + x.shape[3:]),
                                grid["blocks"])}
  for name in NON_BLOCK:
    out[name] = jax.tree.map(lambda x: x[:, 0], grid[name])
  return out


def random_replicas(cfg: ModelConfig, num_replicas: int, seed: int = 0, std: float = 0.05):
  """Parameters of R decoders that all differ (leaves [R, ...]), drawn on the host with numpy.

  For tests and demos of routing, where a wrong replica's weights must change the result: norm
  scales 1 ± 0.1, the embedding N(0, 1), every other weight N(0, std). Numpy instead of the model's
  own initializer because compiling the initializer's random-number program takes seconds on CPU.
  """
  shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: llama.Decoder(cfg, nnx.Rngs(0))),
                                      nnx.Param))
  rng = np.random.default_rng(seed)

  def draw(key_path, leaf):
    name = llama.path_name(key_path)
    noise = rng.standard_normal((num_replicas,) + tuple(leaf.shape)).astype(np.float32)
    if name.endswith("scale"):
      return jnp.asarray(1.0 + 0.1 * noise)
    return jnp.asarray(noise if name == "embed" else std * noise)

  return jax.tree_util.tree_map_with_path(draw, shapes)


class StageFunctions:
  """The pieces of `llama.Decoder.__call__` a pipeline device runs, on pure-dict parameters."""

  def __init__(self, cfg: ModelConfig):
    abstract = nnx.eval_shape(lambda: llama.Decoder(cfg, nnx.Rngs(0)))
    self.cfg = cfg
    self.dtype = jnp.dtype(cfg.dtype)
    self._block_def = nnx.split(abstract.blocks)[0]
    self._norm_def = nnx.split(abstract.final_norm)[0]

  def embed(self, outer, tokens_BxT):
    return jnp.take(outer["embed"], tokens_BxT, axis=0).astype(self.dtype)

  def layers(self, blocks_l, x_BxTxD):
    """The stage's l stacked blocks, in order."""
    cos, sin = llama.rotary_tables(x_BxTxD.shape[1], self.cfg.head_dim, self.cfg.rope_base)
    return llama.run_blocks_scanned(self._block_def, blocks_l, x_BxTxD, cos, sin, self.cfg.remat)

  def head_loss(self, outer, x_BxTxD, targets_BxT):
    x = nnx.merge(self._norm_def, outer["final_norm"])(x_BxTxD)
    return cross_entropy(llama.head_logits(x, outer["head"], self.dtype), targets_BxT)


def layer_path(route: Route, layers_per_stage: int, num_model_layers: int) -> np.ndarray:
  """Indices into the replicas' blocks concatenated [R·L, ...] that `route` runs, in order."""
  return np.concatenate([r * num_model_layers + s * layers_per_stage + np.arange(layers_per_stage)
                         for s, r in zip(route.stages, route.replicas)])


def sequential_loss_and_grads(graphdef, params_R, batch_MxBxT1, routes, num_stages: int,
                              loss_scale: float):
  """The reference: every micro-batch's route run one after another on one device.

  Micro-batch m's model is its origin's embedding, final norm and head with, at each stage of its
  route, the blocks of the replica serving it; its loss is scaled by `loss_scale`.

  Returns:
    (Σ_m loss_scale · loss_m, gradients with respect to params_R, leaves [R, ...]).
  """
  lps = check_split(jax.tree.map(lambda x: x[0], params_R), num_stages)
  total_layers = num_layers(jax.tree.map(lambda x: x[0], params_R))
  loss, grads = 0.0, jax.tree.map(jnp.zeros_like, params_R)
  for m, route in enumerate(routes):
    path = jnp.asarray(layer_path(route, lps, total_layers), jnp.int32)
    value, g = _route_value_and_grad(graphdef, params_R, jnp.asarray(batch_MxBxT1[m]),
                                     route.origin, path)
    loss, grads = loss + loss_scale * value, jax.tree.map(lambda a, b: a + loss_scale * b, grads, g)
  return loss, grads


@functools.partial(jax.jit, static_argnums=0)
def _route_value_and_grad(graphdef, params_R, batch_BxT1, origin, path):
  def loss_fn(p_R):
    merged = {name: jax.tree.map(lambda x: x[origin], p_R[name]) for name in NON_BLOCK}
    merged["blocks"] = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), p_R["blocks"])
    return lm_loss(graphdef, merged, batch_BxT1, path=path)

  return jax.value_and_grad(loss_fn)(params_R)
