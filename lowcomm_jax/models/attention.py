"""Fused attention for accelerators: `jax.nn.dot_product_attention` (cuDNN's flash attention on
NVIDIA GPUs) and jax's Pallas flash attention on TPUs, chosen per platform when a program is lowered
(`model.attention=dot_product`). Operands are [B, T, H, K], time before heads, as the decoder's
projections give them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lowcomm_jax import mesh as mesh_lib


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
  """
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash  # pylint: disable=g-import-not-at-top
  b = _TPU_BLOCK
  blocks = tpu_flash.BlockSizes(
      block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b, block_k_major_dkv=b,
      block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b, block_k_dq=b, block_q_dq=b)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)

  def attend(q, k, v):
    out = tpu_flash.flash_attention(heads_first(q), heads_first(k), heads_first(v), causal=True,
                                    sm_scale=q.shape[-1] ** -0.5, block_sizes=blocks)
    return heads_first(out)

  mesh = jax.sharding.get_abstract_mesh()
  free = () if mesh.empty else tuple(
      name for name, kind in zip(mesh.axis_names, mesh.axis_types)
      if kind != jax.sharding.AxisType.Manual)
  if not free:
    return attend(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  splits = lambda axis, n: axis if axis in free and n % sizes[axis] == 0 else None
  spec = jax.sharding.PartitionSpec(splits(mesh_lib.DATA, q_BxTxHxK.shape[0]), None,
                                    splits(mesh_lib.TENSOR, q_BxTxHxK.shape[2]), None)
  return jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                       axis_names=set(free), check_vma=False)(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK)


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
