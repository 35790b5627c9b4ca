"""Fused attention for accelerators: `jax.nn.dot_product_attention` (cuDNN's flash attention on
NVIDIA GPUs) and jax's Pallas flash attention on TPUs, chosen per platform when a program is lowered
(`model.attention=dot_product`). Operands are [B, T, H, K], time before heads, as the decoder's
projections give them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lowcomm_jax import compat, mesh as mesh_lib


def dot_product_attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK):
  """softmax(q·kᵀ / √K, causal) · v by `jax.nn.dot_product_attention`, time before heads.

  Lowered for cuda, cuDNN's fused (flash) attention where cuDNN is installed and accepts the
  operands (bfloat16 or float16; head_dim a multiple of 8, at most 128); lowered for tpu, jax's
  Pallas TPU flash attention (`tpu_flash_attention`) where the sequence is a multiple of 128: no
  [B, H, T, S] tensor is kept for the backward. Elsewhere, jax's XLA implementation (scores and
  softmax in float32, probabilities in the inputs' dtype). `implementation=None` is not used: in jax
  0.10 to 0.12 it always means XLA.
  """
  xla = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
  cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
  branches = {}
  if _cudnn_accepts(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK):
    branches["cuda"] = cudnn
  if _tpu_flash_accepts(q_BxTxHxK, k_BxSxHxK):
    branches["tpu"] = tpu_flash_attention
  if not branches:
    return xla(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK)
  return jax.lax.platform_dependent(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK, default=xla, **branches)


_TPU_BLOCK = 128  # the TPU kernel's key blocks must be multiples of 128


def _tpu_flash_accepts(q_BxTxHxK, k_BxSxHxK) -> bool:
  """Whether jax's Pallas TPU flash attention takes these shapes: causal self-attention whose
  sequence is a multiple of its 128-long blocks."""
  t, s = q_BxTxHxK.shape[1], k_BxSxHxK.shape[1]
  return t == s and t % _TPU_BLOCK == 0


def tpu_flash_attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK):
  """Causal attention by jax's Pallas TPU flash attention (a Mosaic kernel, forward and backward):
  no [B, H, T, S] tensor in memory. Blocks of 128 queries and keys.

  A Mosaic kernel is not partitioned automatically, so it runs under a `jax.shard_map` manual over
  every mesh axis not already manual, each device on its own rows: the batch split over `data` and
  the heads over `tensor` where they divide, other axes holding whole copies. Traced without a
  mesh, the kernel itself. Runs on TPU only (or in `pltpu.force_tpu_interpret_mode()`).

  Inside a `jax.shard_map` already (the Trainer's one replica per `replica` slice), the operands
  vary over its manual axes and so does the result, typed as the other platforms' attention types
  it. The kernel's results carry no such type, and jax's differentiation of the kernel refuses
  operands that have one; so the kernel's own forward and backward rules are called here, in a
  `jax.custom_vjp` that types the results as the operands (`mesh.vary_like`), the forward's
  residuals (the output and each row's softmax statistics) kept for the backward.
  """
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash  # pylint: disable=g-import-not-at-top
  b = _TPU_BLOCK
  blocks = tpu_flash.BlockSizes(
      block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b, block_k_major_dkv=b,
      block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b, block_k_dq=b, block_q_dq=b)
  scale = q_BxTxHxK.shape[-1] ** -0.5
  mesh = jax.sharding.get_abstract_mesh()
  free = () if mesh.empty else tuple(
      name for name, kind in zip(mesh.axis_names, mesh.axis_types)
      if kind != jax.sharding.AxisType.Manual)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  splits = lambda axis, n: axis if axis in free and n % sizes[axis] == 0 else None
  # [B, H, ...]: the kernel's operands, output and row statistics, batch and heads leading
  rows = jax.sharding.PartitionSpec(splits(mesh_lib.DATA, q_BxTxHxK.shape[0]),
                                    splits(mesh_lib.TENSOR, q_BxTxHxK.shape[2]))

  def per_device(fn, num_in: int, num_out: int):
    if not free:
      return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=(rows,) * num_in, out_specs=(rows,) * num_out,
                         axis_names=set(free), check_vma=False)

  kernel_forward = functools.partial(compat.tpu_flash_attention_forward, sm_scale=scale,
                                     block_sizes=blocks)  # (output, row sums l, row maxima m)
  kernel_backward = functools.partial(compat.tpu_flash_attention_backward, sm_scale=scale,
                                      block_sizes=blocks)

  @jax.custom_vjp
  def attend(q, k, v):
    return attend_forward(q, k, v)[0]

  def attend_forward(q, k, v):
    o, l, m = per_device(kernel_forward, 3, 3)(q, k, v)
    o = mesh_lib.vary_like(o, q, k, v)
    return o, (q, k, v, o, l, m)

  def attend_backward(saved, d_out):
    grads = per_device(kernel_backward, 7, 3)(*saved, d_out)
    return tuple(_cotangent(g, x, d_out) for g, x in zip(grads, saved[:3]))

  attend.defvjp(attend_forward, attend_backward)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)
  return heads_first(attend(heads_first(q_BxTxHxK), heads_first(k_BxSxHxK), heads_first(v_BxSxHxK)))


def _cotangent(grad, operand, d_out):
  """The kernel's gradient for `operand` typed as `operand`: summed over the manual axes the
  output's cotangent varies over and the operand does not (an operand shared by the devices that
  differ there), marked varying over those it varies over."""
  grad = mesh_lib.vary_like(grad, d_out, operand)
  summed = tuple(sorted(mesh_lib.varying_axes(grad) - mesh_lib.varying_axes(operand)))
  return jax.lax.psum(grad, summed) if summed else grad


def _cudnn_accepts(*operands) -> bool:
  """Whether cuDNN's attention traces for these operands: it needs the CUDA plugin with cuDNN, and
  refuses shapes and dtypes its kernels lack, both when traced."""
  if any(x.dtype not in (jnp.bfloat16, jnp.float16) for x in operands):
    return False
  shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands)
  return _cudnn_traces(shapes)


@functools.cache
def _cudnn_traces(shapes) -> bool:
  try:
    jax.eval_shape(jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32)), argnums=(0, 1, 2)),
                   *shapes)
  except (RuntimeError, ValueError, NotImplementedError):
    return False
  return True
