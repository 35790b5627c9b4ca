"""Pallas codec kernels: a grid over tiles of whole blocks, compiled per platform.

Every codec kernel maps a tile of ``rows_per_step`` whole blocks to a tile of
codes and scales (or back), so one grid axis over rows is all that is needed
and a block never straddles two grid steps. The shapes a tile sees are powers
of 2, as Triton requires: the rows are padded with zero blocks to a multiple
of a power-of-2 tile, and a block of ``L`` values is laid out as two halves of
``W`` columns each (``W`` the power of 2 at or above ``L/2``, the 4-bit codecs:
the kernel reads the halves through ref slices and writes their codes as the
low and high nibbles of one byte) or as ``W ≥ L`` columns (the others), zero
padded. Zeros change no block's absmax and code to zero, and the padding is
sliced off after, so the wire layout is the codec's and the codes are
bit-identical to the jnp reference.

Where it runs (``interpret``): ``True``, Pallas interpret mode on any
platform (what the tests compare with the reference on CPU); otherwise the
program holds one branch per platform (``lax.platform_dependent``, resolved
when it is lowered): Pallas Triton on ``cuda`` and Mosaic on ``tpu``, each
chosen with its ``compiler_params`` and its own tile size, and on any other
platform interpret mode (``None``) or the jnp reference (``False``). A
compiled kernel runs under ``jax.shard_map`` manual over every mesh axis not
already manual (Mosaic kernels cannot be partitioned automatically), its
operands replicated within the map.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax.codecs import packing

__all__ = ["COMPILED_PLATFORMS", "MAX_COMPILED_COLUMNS", "TILE_VALUES", "compiled_supported",
           "quantize", "dequantize", "on_every_axis"]

# The platforms with a compiled kernel, each proven to lower by tests/test_lowering.py.
COMPILED_PLATFORMS = ("cuda", "tpu")
# Values per grid step. Interpret mode has a large fixed cost per grid step, so its tiles are large;
# a Triton program holds its tile in registers; a Mosaic tile sits in VMEM, double-buffered.
TILE_VALUES = {"interpret": 1 << 18, "cuda": 1 << 12, "tpu": 1 << 17}
# Rows of a Mosaic tile are a multiple of the 8-bit sublane tiling (32 rows).
_MIN_ROWS = {"interpret": 1, "cuda": 1, "tpu": 32}
# The widest padded block a compiled kernel takes (a Triton program's tile, a VMEM tile).
MAX_COMPILED_COLUMNS = 1 << 13


def _pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def _compiler_params(platform: str):
  if platform == "cuda":
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    return pltriton.CompilerParams(num_warps=4, num_stages=1)
  if platform == "tpu":
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
    return pltpu.CompilerParams(dimension_semantics=("parallel",))
  return None


def _columns(codec, block_len: int) -> int:
  """Padded columns of one block as a kernel sees it: 2 halves of W, or W."""
  return 2 * _pow2(block_len // 2) if codec.packed else _pow2(block_len)


def compiled_supported(codec, block_len: int | None = None) -> bool:
  """Whether a compiled kernel takes this codec (scaled, blocks of at most
  :data:`MAX_COMPILED_COLUMNS` padded values); ``block_len`` defaults to the codec's block size."""
  block_len = codec.block_size if block_len is None else block_len
  return (codec.has_scales and not codec.single_block
          and _columns(codec, block_len) <= MAX_COMPILED_COLUMNS)


def on_every_axis(fn: Callable) -> Callable:
  """``fn`` under ``jax.shard_map`` manual over every axis of the current mesh not already
  manual, operands and results replicated over them; ``fn`` itself without a mesh.

  The results vary over the already-manual axes as the operands do (as ``fn`` traced in place
  would type them), so this and the jnp reference are interchangeable branches.
  """
  def wrapped(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return fn(*args)
    manual = jax.sharding.AxisType.Manual
    free = {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != manual}
    if not free:
      return fn(*args)
    outputs = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=free,
                            check_vma=False)(*args)
    return jax.tree.map(lambda out: mesh_lib.vary_like(out, *jax.tree.leaves(args)), outputs)
  return wrapped


def _rowwise_call(kernel, inputs, out_columns_dtypes, platform: str, rows_per_step: int | None,
                  row_values: int):
  """``kernel`` over tiles of rows of 2-D arrays with power-of-2 columns; outputs ``[rows, cols]``.

  ``row_values``: the values one row stands for (sizes the default tile).
  """
  num_rows = inputs[0].shape[0]
  if rows_per_step is None:
    rows_per_step = max(1, TILE_VALUES[platform] // row_values)
  rows_per_step = max(_pow2(rows_per_step), _MIN_ROWS[platform])
  rows_per_step = min(rows_per_step, max(_pow2(num_rows), _MIN_ROWS[platform]))
  num_steps = -(-num_rows // rows_per_step)
  padded_rows = num_steps * rows_per_step
  inputs = [jnp.pad(a, ((0, padded_rows - num_rows), (0, 0))) for a in inputs]
  # Inside shard_map (check_vma) outputs must say over which mesh axes they
  # vary: as the most varying input does.
  manual_axis_types = [getattr(jax.typeof(a), "manual_axis_type", None) for a in inputs]
  manual_axis_type = max(manual_axis_types,
                         key=lambda mat: -1 if mat is None else len(mat.varying))

  def tile(columns):
    return pl.BlockSpec((rows_per_step, columns), lambda step: (step, 0))

  outputs = pl.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct((padded_rows, columns), dtype,
                                           manual_axis_type=manual_axis_type)
                      for columns, dtype in out_columns_dtypes),
      grid=(num_steps,),
      in_specs=[tile(a.shape[1]) for a in inputs],
      out_specs=tuple(tile(columns) for columns, _ in out_columns_dtypes),
      interpret=platform == "interpret",
      compiler_params=_compiler_params(platform),
  )(*inputs)
  return tuple(out[:num_rows] for out in outputs)


def _halves(a: jax.Array, width: int) -> jax.Array:
  """``[B, L]`` to ``[B, 2W]``: each half of a row zero-padded to W columns."""
  half = a.shape[1] // 2
  if width == half:
    return a
  pad = lambda h: jnp.pad(h, ((0, 0), (0, width - half)))
  return jnp.concatenate([pad(a[:, :half]), pad(a[:, half:])], axis=1)


def _pad_columns(a: jax.Array, columns: int) -> jax.Array:
  return jnp.pad(a, ((0, 0), (0, columns - a.shape[1])))


def _quantize_kernel(codec, platform, x_blocks, bits, rows_per_step):
  block_len = x_blocks.shape[1]
  columns = _columns(codec, block_len)
  parts = 2 if codec.packed else 1
  width = columns // parts
  arrange = (lambda a: _halves(a, width)) if codec.packed else (
      lambda a: _pad_columns(a, columns))
  inputs = [arrange(x_blocks)] + ([] if bits is None else [arrange(bits)])

  def kernel(*refs):
    x_ref, bits_ref = refs[0], (refs[1] if bits is not None else None)
    out_refs = refs[len(inputs):]
    part = lambda ref, i: ref[...] if parts == 1 else ref[:, pl.ds(i * width, width)]
    xs = [part(x_ref, i) for i in range(parts)]
    bs = [None if bits_ref is None else part(bits_ref, i) for i in range(parts)]
    scale = divisor = finite = None
    if codec.has_scales:
      absmax = jnp.max(jnp.abs(xs[0]), axis=1, keepdims=True)
      for x in xs[1:]:  # max is exact: the same absmax as the whole block's
        absmax = jnp.maximum(absmax, jnp.max(jnp.abs(x), axis=1, keepdims=True))
      scale, divisor, finite = scales_from_absmax(absmax, codec.grid_max)
      out_refs[1][...] = scale
    codes = [codec.encode_values(x, divisor, finite, b) for x, b in zip(xs, bs)]
    out_refs[0][...] = packing.pack_pair(*codes) if codec.packed else codes[0]

  from lowcomm_jax.codecs.base import scales_from_absmax  # pylint: disable=g-import-not-at-top
  out_specs = [(width, codec.code_dtype)] + ([(1, jnp.float32)] if codec.has_scales else [])
  outputs = _rowwise_call(kernel, inputs, out_specs, platform, rows_per_step, columns)
  codes = outputs[0][:, :codec.code_columns(block_len)]
  return codes, (outputs[1][:, 0] if codec.has_scales else None)


def _dequantize_kernel(codec, platform, codes, scales, rows_per_step):
  block_len = codes.shape[1] * 2 if codec.packed else codes.shape[1]
  columns = _columns(codec, block_len)
  parts = 2 if codec.packed else 1
  width = columns // parts

  def kernel(*refs):
    codes_ref, out_ref = refs[0], refs[-1]
    scale = refs[1][...] if codec.has_scales else None
    if codec.packed:
      for i, half in enumerate(packing.unpack_pair(codes_ref[...])):
        out_ref[:, pl.ds(i * width, width)] = codec.decode_values(half, scale)
    else:
      out_ref[...] = codec.decode_values(codes_ref[...], scale)

  inputs = [_pad_columns(codes, width)] + ([scales[:, None]] if codec.has_scales else [])
  (out,) = _rowwise_call(kernel, inputs,
                         [(columns, jnp.float32)], platform, rows_per_step, columns)
  if not codec.packed:
    return out[:, :block_len]
  half = block_len // 2
  return out if width == half else jnp.concatenate(
      [out[:, :half], out[:, width:width + half]], axis=1)


def _dispatch(kernel_fn, reference_fn, supported: bool, interpret: bool | None):
  """The kernel per platform (see the module docstring); ``*args -> outputs``."""
  if interpret:
    return lambda *args: kernel_fn("interpret", *args)
  elsewhere = reference_fn if interpret is False else (
      lambda *args: kernel_fn("interpret", *args))
  if not supported:
    return elsewhere
  compiled = {platform: on_every_axis(lambda *args, platform=platform: kernel_fn(platform, *args))
              for platform in COMPILED_PLATFORMS}
  return lambda *args: jax.lax.platform_dependent(*args, default=elsewhere, **compiled)


@functools.partial(jax.jit, static_argnames=("codec", "interpret", "rows_per_step"))
def quantize(x_blocks: jax.Array, bits: jax.Array | None, *, codec, interpret: bool | None,
             rows_per_step: int | None = None):
  """Pallas quantize: fp32 ``[B, L]`` (+ uint32 bits) to ``(codes [B, C], scales [B] or None)``.

  Jitted (traced once per shape and codec: a model's many same-shaped leaves share the trace).

  Args:
    x_blocks: fp32 ``[B, L]``.
    bits: uint32 ``[B, L]`` for stochastic rounding, else None.
    codec: the codec.
    interpret: True: interpret mode; None / False: compiled on cuda and tpu, interpret mode /
      the jnp reference elsewhere.
    rows_per_step: blocks per grid step (rounded up to a power of 2); default per platform.
  """
  kernel = lambda platform, x, b: _quantize_kernel(codec, platform, x, b, rows_per_step)
  reference = lambda x, b: codec.quantize_reference(x, b)
  supported = compiled_supported(codec, x_blocks.shape[1])
  return _dispatch(kernel, reference, supported, interpret)(x_blocks, bits)


@functools.partial(jax.jit, static_argnames=("codec", "interpret", "rows_per_step"))
def dequantize(codes: jax.Array, scales: jax.Array | None, *, codec, interpret: bool | None,
               rows_per_step: int | None = None) -> jax.Array:
  """Pallas dequantize: codes ``[B, C]`` and scales ``[B]`` (or None) to fp32 ``[B, L]`` (see
  :func:`quantize`)."""
  kernel = lambda platform, c, s: _dequantize_kernel(codec, platform, c, s, rows_per_step)
  reference = lambda c, s: codec.dequantize_reference(c, s)
  block_len = codes.shape[1] * 2 if codec.packed else codes.shape[1]
  supported = compiled_supported(codec, block_len)
  return _dispatch(kernel, reference, supported, interpret)(codes, scales)
