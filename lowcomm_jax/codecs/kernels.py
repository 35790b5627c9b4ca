"""Pallas plumbing shared by the codec kernels: a grid over rows of blocks.

Every codec kernel maps a tile of ``rows_per_step`` whole blocks to a tile of
codes and scales (or back), so one grid axis over rows is all that is needed
and a block never straddles two grid steps. The rows are padded to a multiple
of ``rows_per_step`` with zero blocks and the padding is sliced off after.

Interpret mode on CPU has a large fixed cost per grid step, so the default tile
is large (about 2^18 values); tests pass a small ``rows_per_step`` to exercise
several steps.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["DEFAULT_TILE_VALUES", "rowwise_pallas_call", "quantize_pallas", "dequantize_pallas"]

DEFAULT_TILE_VALUES = 1 << 18


def rowwise_pallas_call(
    kernel: Callable[..., None],
    inputs: Sequence[jax.Array],
    out_columns_dtypes: Sequence[tuple[int, jnp.dtype]],
    *,
    values_per_row: int,
    interpret: bool,
    rows_per_step: int | None = None,
) -> tuple[jax.Array, ...]:
  """Runs ``kernel`` over tiles of rows of 2-D arrays that share their rows.

  Args:
    kernel: Pallas kernel taking one ref per input then one per output.
    inputs: 2-D arrays with the same number of rows.
    out_columns_dtypes: ``(columns, dtype)`` of each 2-D output.
    values_per_row: values one row stands for (sizes the default tile).
    interpret: Pallas interpret mode (required on CPU).
    rows_per_step: rows per grid step; default about
      :data:`DEFAULT_TILE_VALUES` values per step.

  Returns:
    The outputs, each ``[rows, columns]``.
  """
  num_rows = inputs[0].shape[0]
  if rows_per_step is None:
    rows_per_step = max(1, DEFAULT_TILE_VALUES // max(values_per_row, 1))
  rows_per_step = max(1, min(int(rows_per_step), num_rows))
  num_steps = -(-num_rows // rows_per_step)
  padded_rows = num_steps * rows_per_step
  padded_inputs = [jnp.pad(a, ((0, padded_rows - num_rows), (0, 0))) for a in inputs]

  # Inside shard_map (check_vma) outputs must say over which mesh axes they
  # vary: as the most varying input does.
  manual_axis_types = [getattr(jax.typeof(a), "manual_axis_type", None) for a in padded_inputs]
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
      in_specs=[tile(a.shape[1]) for a in padded_inputs],
      out_specs=tuple(tile(columns) for columns, _ in out_columns_dtypes),
      interpret=interpret,
  )(*padded_inputs)
  return tuple(out[:num_rows] for out in outputs)


def quantize_pallas(
    quantize_tile: Callable,
    x_blocks: jax.Array,
    bits: jax.Array | None,
    codes_columns_dtype: tuple[int, jnp.dtype],
    *,
    with_scales: bool,
    interpret: bool,
    rows_per_step: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Pallas quantize kernel around a codec's tile function.

  Args:
    quantize_tile: ``(x [R, L], bits [R, L] or None) -> codes`` or
      ``-> (codes, scale [R, 1])`` when ``with_scales``.
    x_blocks: fp32 ``[B, L]``.
    bits: uint32 ``[B, L]`` for stochastic rounding, else None.
    codes_columns_dtype: ``(columns, dtype)`` of the codes.
    with_scales: whether the codec emits one scale per block.
    interpret: Pallas interpret mode.
    rows_per_step: blocks per grid step.

  Returns:
    ``(codes [B, C], scales [B] or None)``.
  """
  def kernel(*refs):
    num_inputs = 1 if bits is None else 2
    tile_bits = None if bits is None else refs[1][...]
    result = quantize_tile(refs[0][...], tile_bits)
    outputs = result if with_scales else (result,)
    for out_ref, value in zip(refs[num_inputs:], outputs):
      out_ref[...] = value

  inputs = [x_blocks] if bits is None else [x_blocks, bits]
  out_specs = [codes_columns_dtype] + ([(1, jnp.float32)] if with_scales else [])
  outputs = rowwise_pallas_call(kernel, inputs, out_specs, values_per_row=x_blocks.shape[1],
                                interpret=interpret, rows_per_step=rows_per_step)
  return (outputs[0], outputs[1][:, 0]) if with_scales else (outputs[0], None)


def dequantize_pallas(
    dequantize_tile: Callable,
    codes: jax.Array,
    scales: jax.Array | None,
    block_len: int,
    *,
    interpret: bool,
    rows_per_step: int | None = None,
) -> jax.Array:
  """Pallas dequantize kernel around a codec's tile function.

  Args:
    dequantize_tile: ``(codes [R, C], scale [R, 1] or None) -> fp32 [R, L]``.
    codes: ``[B, C]``.
    scales: fp32 ``[B]`` or None.
    block_len: ``L``, values per block.
    interpret: Pallas interpret mode.
    rows_per_step: blocks per grid step.

  Returns:
    fp32 ``[B, L]``.
  """
  def kernel(*refs):
    tile_scale = refs[1][...] if scales is not None else None
    refs[-1][...] = dequantize_tile(refs[0][...], tile_scale)

  inputs = [codes] if scales is None else [codes, scales[:, None]]
  (out,) = rowwise_pallas_call(kernel, inputs, [(block_len, jnp.float32)],
                               values_per_row=block_len, interpret=interpret,
                               rows_per_step=rows_per_step)
  return out
