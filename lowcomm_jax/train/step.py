"""Pure step builders: the loss, the optimizer from the config, the train and eval steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class TrainState(NamedTuple):
  """Data-parallel training state; pure pytrees so optax, jit and orbax all see plain arrays."""

  params: Any  # pure dict of float32 arrays
  opt_state: Any
  step: jax.Array  # int32[]


def cross_entropy(logits_BxTxV, targets_BxT) -> jax.Array:
  """Mean next-token cross-entropy in nats."""
  logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1).mean()


def lm_loss(graphdef, params, batch_BxT1, path=None) -> jax.Array:
  """Loss of the model on windows [B, T + 1]: inputs are the first T tokens, targets the last T."""
  model = nnx.merge(graphdef, params)
  return cross_entropy(model(batch_BxT1[:, :-1], path=path), batch_BxT1[:, 1:])


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


def learning_rate_schedule(opt_cfg, num_steps: int) -> optax.Schedule:
  """Linear warm-up to the peak, then cosine decay to min_lr_ratio · peak at num_steps."""
  peak = opt_cfg.learning_rate
  warmup = min(opt_cfg.warmup_steps, max(num_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else peak, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(num_steps, warmup + 1), end_value=peak * opt_cfg.min_lr_ratio)


def make_optimizer(opt_cfg, num_steps: int) -> optax.GradientTransformation:
  """The inner optimizer named by `config.optimizer`, with clipping."""
  lr = learning_rate_schedule(opt_cfg, num_steps)
  if opt_cfg.name == "adamw":
    tx = optax.adamw(lr, b1=opt_cfg.b1, b2=opt_cfg.b2, weight_decay=opt_cfg.weight_decay)
  elif opt_cfg.name == "adam":
    tx = optax.adam(lr, b1=opt_cfg.b1, b2=opt_cfg.b2)
  else:
    tx = optax.sgd(lr, momentum=opt_cfg.momentum or None)
  if opt_cfg.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(opt_cfg.grad_clip), tx)
  return tx


def make_train_step(graphdef, tx: optax.GradientTransformation):
  """(state, batch) -> (state, metrics): one optimizer step on a batch [B, T + 1]."""

  def train_step(state: TrainState, batch_BxT1):
    loss, grads = jax.value_and_grad(lambda p: lm_loss(graphdef, p, batch_BxT1))(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return TrainState(params, opt_state, state.step + 1), metrics

  return train_step


def make_eval_step(graphdef):
  """(params, batch) -> mean loss of the batch."""
  return lambda params, batch_BxT1: lm_loss(graphdef, params, batch_BxT1)
