"""The language-model loss of the decoder, and its gradient over micro-batches of a batch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def cross_entropy(logits_BxTxV, targets_BxT) -> jax.Array:
  """Mean next-token cross-entropy in nats."""
  logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1).mean()


def lm_loss(graphdef, params, batch_BxT1, path=None) -> jax.Array:
  """Loss of the model on windows [B, T + 1]: inputs are the first T tokens, targets the last T."""
  model = nnx.merge(graphdef, params)
  return cross_entropy(model(batch_BxT1[:, :-1], path=path), batch_BxT1[:, 1:])


# The model's loss and its gradient as jitted functions, one object per model (`graphdef`): every
# step program of a run (one per phase: sync or not, which fragment is due), its eval program and
# every other run of the same model call the same function, so JAX traces the model's forward and
# backward once per model, batch shape and mesh, and each program takes the traced jaxpr (vmapped
# over the replicas, or inside a `shard_map`) from JAX's caches; XLA inlines the call when it
# compiles, so the compiled programs are those of the model written inline.


@functools.lru_cache(maxsize=16)
def jitted_loss(graphdef):
  """`(params, batch) -> lm_loss` of the model `graphdef`, jitted once per model."""
  return jax.jit(functools.partial(lm_loss, graphdef))


@functools.lru_cache(maxsize=16)
def jitted_loss_and_grads(graphdef):
  """`(params, batch) -> (lm_loss, its gradient)` of the model `graphdef`, jitted once per model."""
  return jax.jit(jax.value_and_grad(functools.partial(lm_loss, graphdef)))


def accumulate(loss_and_grads, steps: int):
  """`loss_and_grads(params, batch)` over `steps` micro-batches of the batch, one after another.

  Micro-batch j of a batch [B, T + 1] holds rows j, j + k, j + 2k, … (k = `steps`), so each is
  laid out over the mesh's data axis as the batch is (contiguous rows per device) and moves no
  data; a `lax.scan` runs them, so only one micro-batch's activations are alive at a time. Returns
  the mean of their losses and of their gradients: every micro-batch has B/k rows of T tokens, so
  that is the loss and the gradient of the whole batch, up to the order of the float32 sums.
  `steps` = 1 returns `loss_and_grads` itself.
  """
  if steps == 1:
    return loss_and_grads

  def accumulated(params, batch_BxT1):
    b = batch_BxT1.shape[0]
    micro_KxMxT1 = batch_BxT1.reshape(b // steps, steps, *batch_BxT1.shape[1:]).swapaxes(0, 1)
    shapes = jax.eval_shape(loss_and_grads, params, micro_KxMxT1[0])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def add(total, micro_MxT1):
      return jax.tree.map(jnp.add, total, loss_and_grads(params, micro_MxT1)), None

    total, _ = jax.lax.scan(add, zeros, micro_KxMxT1)
    return jax.tree.map(lambda x: x / steps, total)

  return accumulated
