"""Causal attention as one fused CPU kernel: `ModelConfig.attention = "cpu_kernel"`.

XLA:CPU runs `llama.causal_attention` as batched dots with the softmax between them, and writes the
whole [B, H, T, S] probability tensor (and its gradient) to memory between them, with transposed
copies of k and v for the dots; on the `small` model that is a large share of a training step's CPU
time, more than torch's fused CPU attention costs (benchmarks/results/README.md, 2026-11-24, pass
5). This module runs the same function as two custom calls (XLA FFI, `attention.cc`), forward and
backward, each working one (batch, head) slice at a time in cache:

  forward   S = q·kᵀ/√K (causal), O = softmax(S)·v, and the log-sum-exp L of each row of S
  backward  P = exp(S − L) recomputed, dP = dO·vᵀ, dS = P ⊙ (dP − rowsum(dO ⊙ O)) / √K,
            dQ = dS·k, dK = dSᵀ·q, dV = Pᵀ·dO

(softmax attention's vector-Jacobian product, with L saved instead of P). The arithmetic is the same
up to float32 rounding (sums in another order; the outputs and gradients agree with the XLA path to
~1e-6 relative, tests/test_cpu_kernels.py). Operands are [B, T, H, K] (the projections' layout: no
transposed copies around the calls). float32 only, head_dim 16, 32, 64 or 128, any T (padded to a
multiple of 4 here), CPU only.

The kernel is compiled on first use into a private per-user cache and verified before it is loaded
(`cpu_kernels/build.py`: no `-ffast-math`, so NaN propagates as in the XLA path; the cache key
holds the CPU's feature flags). `load()` raises a clear error (no compiler, compile failure, a cache
that cannot be trusted) before any compute; the Trainer calls it when it is built. This module is
imported only when `model.attention = "cpu_kernel"`.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import jax
import jax.numpy as jnp
from jax import custom_batching
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax.cpu_kernels import build

_SOURCE = pathlib.Path(__file__).with_name("attention.cc")
_OPTION = "model.attention='cpu_kernel'"
HEAD_DIMS = (16, 32, 64, 128)  # the kernel's compiled head widths
_ROWS = 4  # the kernel's query-row block: T is padded to a multiple of it
_FORWARD, _BACKWARD = "lowcomm_attention_forward", "lowcomm_attention_backward"


@functools.cache
def load() -> pathlib.Path:
  """Builds (once per host and jaxlib) and registers the kernel with XLA; returns the library."""
  library = build.build(_SOURCE, _OPTION)
  handle = ctypes.cdll.LoadLibrary(str(library))
  jax.ffi.register_ffi_target(_FORWARD, jax.ffi.pycapsule(handle.LowcommAttentionForward),
                              platform="cpu")
  jax.ffi.register_ffi_target(_BACKWARD, jax.ffi.pycapsule(handle.LowcommAttentionBackward),
                              platform="cpu")
  return library


def check(dtype, head_dim: int) -> None:
  """Raises ValueError unless the kernel supports this compute dtype and head width."""
  if jnp.dtype(dtype) != jnp.float32:
    raise ValueError(f"model.attention='cpu_kernel' computes in float32 only; model.dtype "
                     f"is {dtype!r} (use model.attention='xla' for bfloat16)")
  if head_dim not in HEAD_DIMS:
    raise ValueError(f"model.attention='cpu_kernel' supports head_dim (d_model // num_heads) in "
                     f"{HEAD_DIMS}, got {head_dim} (use model.attention='xla')")


def _pad_time(x, t_padded: int):
  return jnp.pad(x, [(0, 0)] * (x.ndim - 3) + [(0, t_padded - x.shape[-3]), (0, 0), (0, 0)])


def _result_shapes(name: str, args) -> tuple[jax.ShapeDtypeStruct, ...]:
  q = args[0]
  if name == _FORWARD:  # the output and the log-sum-exp of each query row
    return (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:-1], q.dtype))
  return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args[:3])  # dq, dk, dv


def _ffi(name: str, *args):
  # broadcast_all: under vmap every operand gets the batch axis in front, which the kernel treats as
  # more leading (batch × heads) slices.
  return jax.ffi.ffi_call(name, _result_shapes(name, args), vmap_method="broadcast_all")(*args)


def _per_slice(sharding, ndim: int) -> PartitionSpec:
  """The operands' spec: q's sharding of the batch and head axes, time and head_dim whole."""
  spec = tuple(getattr(sharding, "spec", ())) + (None,) * ndim
  return PartitionSpec(*spec[:ndim - 3], None, spec[ndim - 2], None)


def _shardings(mesh, spec: PartitionSpec, shapes):
  # [..., T, H, K] operands take `spec`, the [..., T, H] log-sum-exp the same without its last axis
  full = len(spec)
  return tuple(NamedSharding(mesh, spec if len(s.shape) == full else PartitionSpec(*spec[:-1]))
               for s in shapes)


def _partitioned(name: str):
  """The custom call under `custom_partitioning`: sharded over its batch and head axes it runs on
  each device's own slices, where a bare custom call would be all-gathered to every device."""

  @custom_partitioning
  def call(*args):
    return _ffi(name, *args)

  def infer(mesh, arg_shapes, result_shape, of_args=False):
    spec = _per_slice(arg_shapes[0].sharding, len(arg_shapes[0].shape))
    return _shardings(mesh, spec, arg_shapes if of_args else jax.tree.leaves(result_shape))

  def partition(mesh, arg_shapes, result_shape):
    return (mesh, functools.partial(_ffi, name), infer(mesh, arg_shapes, result_shape),
            infer(mesh, arg_shapes, result_shape, of_args=True))

  x, lse = "... t h k", "... t h"
  rule = {_FORWARD: f"{x}, {x}, {x} -> {x}, {lse}",
          _BACKWARD: f"{x}, {x}, {x}, {x}, {lse}, {x} -> {x}, {x}, {x}"}[name]
  call.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=("t", "k"))

  # custom_partitioning has no batching rule; the kernel takes a vmapped axis as one more leading
  # axis of slices, so vmap (the Trainer's stacked replicas) calls it on the batched operands.
  @custom_batching.custom_vmap
  def batchable(*args):
    return call(*args)

  @batchable.def_vmap
  def _(axis_size, in_batched, *args):
    args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a,
            b in zip(args, in_batched)]
    out = call(*args)
    return out, tuple(True for _ in out)

  return batchable


_PARTITIONED = {name: _partitioned(name) for name in (_FORWARD, _BACKWARD)}


def _run(name: str, *args):
  # Inside `jax.shard_map` (manual mesh axes: the Trainer's one replica per device slice) the call
  # is already per device, and custom_partitioning does not apply there; a mesh axis left automatic
  # inside it (mesh.data > 1 beside mesh.replica > 1) then sees its slices gathered to every device.
  if jax.sharding.get_abstract_mesh().manual_axes:
    return _ffi(name, *args)
  return _PARTITIONED[name](*args)


@jax.custom_vjp
def causal_attention(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK):
  """softmax(q·kᵀ / √K, causal) · v per head, by the fused CPU kernel, time before heads.

  `llama.causal_attention` of the [B, H, T, K] transposes, transposed back: this layout is the
  projections' own, so no operand or result is copied around the call.
  """
  return _forward(q_BxTxHxK, k_BxSxHxK, v_BxSxHxK)[0]


def _forward(q, k, v):
  load()
  check(q.dtype, q.shape[-1])
  t = q.shape[-3]
  # Padded keys sit after every real query, so the causal mask hides them; padded query rows are
  # cut from the output and get a zero cotangent.
  t_padded = -(-t // _ROWS) * _ROWS
  q, k, v = (_pad_time(x, t_padded) for x in (q, k, v))
  out, lse = (mesh_lib.vary_like(x, q) for x in _run(_FORWARD, q, k, v))
  return out[..., :t, :, :], (q, k, v, out, lse)


def _backward(saved, d_out):
  q, k, v, out, lse = saved
  t = d_out.shape[-3]
  d_out = _pad_time(d_out, q.shape[-3])
  grads = _run(_BACKWARD, q, k, v, out, lse, d_out)
  return tuple(mesh_lib.vary_like(g[..., :t, :, :], x) for g, x in zip(grads, (q, k, v)))


causal_attention.defvjp(_forward, _backward)
