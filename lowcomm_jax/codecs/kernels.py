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

On GPUs there are two kernels (``gpu``): Pallas Mosaic GPU, JAX's maintained
GPU backend, and Pallas Triton, deprecated from JAX 0.11. :func:`gpu_kernel`
picks per JAX version and GPU: Mosaic GPU where the installed JAX compiles it
for the GPU, else Triton where JAX still has it, else the jnp reference. The
Mosaic GPU kernel walks its tile a block at a time (:func:`_mosaic_gpu_call`);
both share the codecs' value math, so the codes are the same.

Where it runs (``interpret``): ``True``, Pallas interpret mode on any
platform (what the tests compare with the reference on CPU: the Mosaic GPU
kernel's body, or the Triton and TPU one's); otherwise the program holds one
branch per platform (``lax.platform_dependent``, resolved when it is
lowered): the GPU kernel on ``cuda`` and Mosaic on ``tpu``, each chosen with
its ``compiler_params`` and its own tile size, and on any other platform
interpret mode (``None``) or the jnp reference (``False``). A compiled kernel
runs under ``jax.shard_map`` manual over every mesh axis not already manual
(Mosaic kernels cannot be partitioned automatically), its operands replicated
within the map.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax.codecs import packing
from lowcomm_jax.codecs.scales import scales_from_absmax

__all__ = ["COMPILED_PLATFORMS", "GPU_KERNELS", "MAX_COMPILED_COLUMNS", "TILE_VALUES",
           "compiled_supported", "gpu_kernel", "gpu_kernel_available", "gpu_kernel_refusal",
           "quantize", "dequantize", "on_every_axis"]

# The platforms with a compiled kernel, each proven to lower by tests/test_lowering.py.
COMPILED_PLATFORMS = ("cuda", "tpu")
# The compiled GPU kernels: Pallas Mosaic GPU (JAX's maintained GPU backend) and Pallas Triton.
GPU_KERNELS = ("mosaic_gpu", "triton")
# Values per grid step. Interpret mode has a large fixed cost per grid step, so its tiles are large;
# a Triton program holds its tile in registers; a Mosaic GPU tile sits in shared memory (at most
# 8192 values: 147 KiB, double-buffered, for stochastic rounding's fp32 values and uint32 bits); a
# Mosaic tile sits in VMEM, double-buffered.
TILE_VALUES = {"interpret": 1 << 18, "triton": 1 << 12, "mosaic_gpu": 1 << 13, "tpu": 1 << 17}
# Rows of a Mosaic tile are a multiple of the 8-bit sublane tiling (32 rows); a Mosaic GPU tile's
# scales (16 bytes a row) are a multiple of its warpgroup's 128 threads' bytes.
_MIN_ROWS = {"interpret": 1, "triton": 1, "tpu": 32, "mosaic_gpu": 8}
# The widest padded block a compiled kernel takes (a Triton program's tile, a VMEM tile, a shared
# memory tile).
MAX_COMPILED_COLUMNS = 1 << 13
# A Mosaic GPU kernel's rows (a block, or half of one) are at least one value per thread of its
# warpgroup.
MOSAIC_GPU_MIN_WIDTH = 128
# Thread blocks of a Mosaic GPU kernel (each pipelines its share of the tiles): a few per
# multiprocessor of the largest GPUs.
MOSAIC_GPU_CTAS = 512
# The first JAX whose Mosaic GPU lowers for Ampere (before it, Hopper and newer only).
_MOSAIC_GPU_AMPERE_JAX = (0, 11)


def _pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def _jax_version() -> tuple[int, ...]:
  return tuple(int(part) for part in jax.__version__.split(".")[:2])


@functools.cache
def gpu_kernel_available(kernel: str) -> bool:
  """Whether the installed JAX has the Pallas backend of a :data:`GPU_KERNELS` entry."""
  module = {"mosaic_gpu": "mosaic_gpu", "triton": "triton"}[kernel]
  try:
    importlib.import_module(f"jax.experimental.pallas.{module}")
  except ImportError:
    return False
  return True


def _compute_capability(device) -> tuple[int, int] | None:
  """A GPU's compute capability: a device's own, or read off an abstract device's kind (``None``
  where unknown)."""
  capability = getattr(device, "compute_capability", None)
  if capability:
    major, minor = str(capability).split(".")[:2]
    return int(major), int(minor)
  kind = getattr(device, "device_kind", "") or ""
  for pattern, value in ((r"\bG?B\d{3}\b", (10, 0)), (r"\bG?H\d{3}\b", (9, 0)),
                         (r"\bL\d{1,2}S?\b|RTX 40", (8, 9)), (r"\bA\d{1,3}\b|RTX 30", (8, 0))):
    if re.search(pattern, kind):
      return value
  return None


def _current_gpu():
  """The GPU a program is traced for: the abstract mesh's device, else this host's first GPU."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None:
    return device
  try:
    return jax.devices("gpu")[0]
  except RuntimeError:
    return None


def gpu_kernel_refusal(kernel: str | None, device=None) -> str | None:
  """Why the GPU kernel ``kernel`` (one of :data:`GPU_KERNELS`; ``None``: the one
  :func:`gpu_kernel` picks) cannot compile with the installed JAX on ``device`` (default: the GPU
  the program is traced for), or ``None`` where it can."""
  version = jax.__version__
  if kernel is None:
    return None if gpu_kernel(device) != "reference" else (
        f"jax {version} has no Pallas GPU backend that compiles the codec kernels for this GPU")
  if not gpu_kernel_available(kernel):
    return f"jax {version} has no jax.experimental.pallas.{kernel}"
  if kernel == "mosaic_gpu":
    device = _current_gpu() if device is None else device
    capability = _compute_capability(device) if device is not None else None
    major = 8 if _jax_version() >= _MOSAIC_GPU_AMPERE_JAX else 9
    if capability is not None and capability[0] < major:
      kind = getattr(device, "device_kind", "this GPU")
      return (f"Pallas Mosaic GPU in jax {version} compiles for compute capability {major}.0 "
              f"and newer; {kind} has {capability[0]}.{capability[1]}")
  return None


def gpu_kernel(device=None) -> str:
  """The compiled GPU kernel for the installed JAX on ``device`` (default: the GPU the program is
  traced for; an unknown GPU counts as a current one): ``mosaic_gpu`` where JAX's Mosaic GPU takes
  the codecs (Hopper and newer; Ampere too from JAX 0.11), else ``triton`` where JAX still has it,
  else ``reference`` (the jnp reference)."""
  for kernel in GPU_KERNELS:
    if gpu_kernel_refusal(kernel, device) is None:
      return kernel
  return "reference"


def _compiler_params(backend: str):
  if backend == "triton":
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    return pltriton.CompilerParams(num_warps=4, num_stages=1)
  if backend == "mosaic_gpu":
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
    # Lane semantics (a thread's values, as Triton's), the default until JAX 0.12.
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
    return pltpu.CompilerParams(dimension_semantics=("parallel",))
  return None


def _columns(codec, block_len: int, min_width: int = 1) -> int:
  """Padded columns of one block as a kernel sees it: 2 halves of W, or W (at least
  ``min_width``)."""
  if codec.packed:
    return 2 * max(_pow2(block_len // 2), min_width)
  return max(_pow2(block_len), min_width)


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
    # Every axis already manual: `fn` runs in place, but a kernel whose outputs carry no varying
    # axes (Mosaic GPU's) still needs them marked, as the shard_map's results do.
    outputs = fn(*args) if not free else jax.shard_map(
        fn, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=free, check_vma=False)(*args)
    return jax.tree.map(lambda out: mesh_lib.vary_like(out, *jax.tree.leaves(args)), outputs)
  return wrapped


def _out_shapes(inputs, rows: int, out_columns_dtypes):
  """The outputs' ``[rows, columns]`` shapes. Inside shard_map (check_vma) outputs must say over
  which mesh axes they vary: as the most varying input does."""
  manual_axis_types = [getattr(jax.typeof(a), "manual_axis_type", None) for a in inputs]
  manual_axis_type = max(manual_axis_types,
                         key=lambda mat: -1 if mat is None else len(mat.varying))
  return tuple(jax.ShapeDtypeStruct((rows, columns), dtype, manual_axis_type=manual_axis_type)
               for columns, dtype in out_columns_dtypes)


def _rowwise_call(kernel, inputs, out_columns_dtypes, backend: str, rows_per_step: int | None,
                  row_values: int):
  """``kernel`` over tiles of rows of 2-D arrays with power-of-2 columns; outputs ``[rows, cols]``.

  ``row_values``: the values one row stands for (sizes the default tile).
  """
  num_rows = inputs[0].shape[0]
  if rows_per_step is None:
    rows_per_step = max(1, TILE_VALUES[backend] // row_values)
  rows_per_step = max(_pow2(rows_per_step), _MIN_ROWS[backend])
  rows_per_step = min(rows_per_step, max(_pow2(num_rows), _MIN_ROWS[backend]))
  num_steps = -(-num_rows // rows_per_step)
  padded_rows = num_steps * rows_per_step
  inputs = [jnp.pad(a, ((0, padded_rows - num_rows), (0, 0))) for a in inputs]

  def tile(columns):
    return pl.BlockSpec((rows_per_step, columns), lambda step: (step, 0))

  outputs = pl.pallas_call(
      kernel,
      out_shape=_out_shapes(inputs, padded_rows, out_columns_dtypes),
      grid=(num_steps,),
      in_specs=[tile(a.shape[1]) for a in inputs],
      out_specs=tuple(tile(columns) for columns, _ in out_columns_dtypes),
      interpret=backend == "interpret",
      compiler_params=_compiler_params(backend),
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


def _layout(codec, block_len: int, min_width: int = 1) -> tuple[int, int, int]:
  """(padded columns, parts, columns per part) of a block as a kernel sees it (:func:`_columns`)."""
  columns = _columns(codec, block_len, min_width)
  parts = 2 if codec.packed else 1
  return columns, parts, columns // parts


def _arranged(codec, arrays, columns: int, width: int) -> list:
  """The arrays (None left out) as a kernel reads them: halves of ``width`` (4-bit) or
  ``columns`` columns, zero padded."""
  arrange = (lambda a: _halves(a, width)) if codec.packed else (
      lambda a: _pad_columns(a, columns))
  return [arrange(a) for a in arrays if a is not None]


def _magnitude_max(x: jax.Array, axis: int | None = None) -> jax.Array:
  """The largest ``|x|`` (over ``axis`` kept, or all), inf where ``x`` holds a NaN: Triton's max
  skips NaNs, and a NaN or an inf makes the block's scale NaN and its codes zero alike."""
  magnitude = jnp.where(x == x, jnp.abs(x), jnp.inf)  # pylint: disable=comparison-with-itself
  return jnp.max(magnitude, axis=axis, keepdims=axis is not None)


def _quantize_kernel(codec, backend, x_blocks, bits, rows_per_step):
  block_len = x_blocks.shape[1]
  columns, parts, width = _layout(codec, block_len)
  inputs = _arranged(codec, [x_blocks, bits], columns, width)

  def kernel(*refs):
    x_ref, bits_ref = refs[0], (refs[1] if bits is not None else None)
    out_refs = refs[len(inputs):]
    part = lambda ref, i: ref[...] if parts == 1 else ref[:, pl.ds(i * width, width)]
    xs = [part(x_ref, i) for i in range(parts)]
    bs = [None if bits_ref is None else part(bits_ref, i) for i in range(parts)]
    scale = divisor = finite = None
    if codec.has_scales:
      # max is exact: the same absmax as the whole block's
      absmax = functools.reduce(jnp.maximum, [_magnitude_max(x, axis=1) for x in xs])
      scale, divisor, finite = scales_from_absmax(absmax, codec.grid_max)
      out_refs[1][...] = scale
    codes = [codec.encode_values(x, divisor, finite, b) for x, b in zip(xs, bs)]
    out_refs[0][...] = packing.pack_pair(*codes) if codec.packed else codes[0]

  out_specs = [(width, codec.code_dtype)] + ([(1, jnp.float32)] if codec.has_scales else [])
  outputs = _rowwise_call(kernel, inputs, out_specs, backend, rows_per_step, columns)
  codes = outputs[0][:, :codec.code_columns(block_len)]
  return codes, (outputs[1][:, 0] if codec.has_scales else None)


def _dequantize_kernel(codec, backend, codes, scales, rows_per_step):
  block_len = codes.shape[1] * 2 if codec.packed else codes.shape[1]
  columns, _, width = _layout(codec, block_len)

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
                         [(columns, jnp.float32)], backend, rows_per_step, columns)
  return _unarrange(codec, out, block_len, width)


def _unarrange(codec, out, block_len: int, width: int):
  """A kernel's padded ``[B, columns]`` values back to blocks ``[B, block_len]``."""
  if not codec.packed:
    return out[:, :block_len]
  half = block_len // 2
  return out if width == half else jnp.concatenate(
      [out[:, :half], out[:, width:width + half]], axis=1)

def _segment(width: int) -> int:
  """Values per segment of a Mosaic GPU row: the bulk copy engine copies boxes of at most 256
  values a side."""
  return min(width, 256)


def _mosaic_gpu_call(kernel, inputs, out_columns_dtypes, interpret: bool,
                     rows_per_step: int | None, row_values: int, segment: int):
  """``kernel(row, *refs)`` for each row of tiles of 2-D arrays, by Pallas Mosaic GPU (or its body
  interpreted); outputs ``[rows, cols]``.

  A Mosaic GPU register array reduces along an axis only in the matrix units' layouts (64 rows
  a warpgroup), too many rows of a block for shared memory, so the kernel walks its tile a row (a
  block) at a time and reduces each row whole. The refs are 3-D, a row as segments of ``segment``
  values (:func:`_part`); a block's scale travels as a row of 4 (16 bytes, the copy engine's
  unit). Compiled, at most :data:`MOSAIC_GPU_CTAS` thread blocks each pipeline their share of the
  tiles (``plgpu.kernel`` and ``plgpu.emit_pipeline``: what every supported JAX offers; the
  grid-over-``pallas_call`` form left Mosaic GPU in JAX 0.12), the next tile's copy in flight
  while one is computed.
  """
  num_rows = inputs[0].shape[0]
  if rows_per_step is None:
    rows_per_step = max(1, TILE_VALUES["interpret" if interpret else "mosaic_gpu"] // row_values)
  rows_per_step = max(min(_pow2(rows_per_step), _pow2(num_rows), 256), _MIN_ROWS["mosaic_gpu"])
  num_steps = -(-num_rows // rows_per_step)
  ctas = 1 if interpret else min(num_steps, MOSAIC_GPU_CTAS)
  steps_per_cta = -(-num_steps // ctas)
  padded_rows = ctas * steps_per_cta * rows_per_step
  split = lambda columns: (columns // segment, segment) if columns >= segment else (1, columns)
  inputs = [jnp.pad(a, ((0, padded_rows - num_rows), (0, 0))).reshape(
      (padded_rows,) + split(a.shape[1])) for a in inputs]
  out_shapes = tuple(jax.ShapeDtypeStruct((padded_rows,) + split(columns), shape.dtype,
                                          manual_axis_type=shape.manual_axis_type)
                     for (columns, _), shape in zip(
                         out_columns_dtypes, _out_shapes(inputs, padded_rows, out_columns_dtypes)))

  def rows(*refs):
    jax.lax.fori_loop(0, rows_per_step, lambda row, carry: (kernel(row, *refs), carry)[1], 0)

  if interpret:
    def tile(columns):
      return pl.BlockSpec((rows_per_step,) + split(columns), lambda step: (step, 0, 0))
    outputs = pl.pallas_call(
        rows, out_shape=out_shapes, grid=(num_steps,),
        in_specs=[tile(a.shape[1] * a.shape[2]) for a in inputs],
        out_specs=tuple(tile(columns) for columns, _ in out_columns_dtypes), interpret=True,
    )(*inputs)
  else:
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

    def tile(columns):
      return pl.BlockSpec((rows_per_step,) + split(columns),
                          lambda step: (step * ctas + jax.lax.axis_index("cta"), 0, 0))

    def body(*refs):
      plgpu.emit_pipeline(
          lambda _, *tile_refs: rows(*tile_refs), grid=(steps_per_cta,),
          in_specs=[tile(a.shape[1] * a.shape[2]) for a in inputs],
          out_specs=[tile(columns) for columns, _ in out_columns_dtypes],
          max_concurrent_steps=2)(*refs)

    outputs = plgpu.kernel(body, out_type=out_shapes, grid=(ctas,), grid_names=("cta",),
                           compiler_params=_compiler_params("mosaic_gpu"))(*inputs)
  return tuple(out.reshape(padded_rows, -1)[:num_rows] for out in outputs)


def _part(ref, row, start: int, width: int):
  """Values ``start`` to ``start + width`` of a row of a 3-D Mosaic GPU ref, as segments."""
  segment = ref.shape[-1]
  return ref[row, pl.ds(start // segment, width // segment), :]


def _mosaic_gpu_quantize(codec, interpret, x_blocks, bits, rows_per_step):
  block_len = x_blocks.shape[1]
  columns, parts, width = _layout(codec, block_len, MOSAIC_GPU_MIN_WIDTH)
  inputs = _arranged(codec, [x_blocks, bits], columns, width)

  def kernel(row, *refs):
    x_ref, bits_ref = refs[0], (refs[1] if bits is not None else None)
    codes_ref, scale_ref = refs[len(inputs):]
    xs = [_part(x_ref, row, i * width, width) for i in range(parts)]
    bs = [None if bits_ref is None else _part(bits_ref, row, i * width, width)
          for i in range(parts)]
    absmax = functools.reduce(jnp.maximum, [_magnitude_max(x) for x in xs])
    scale, divisor, finite = scales_from_absmax(absmax, codec.grid_max)
    scale_ref[row, 0, 0] = scale
    codes = [codec.encode_values(x, divisor, finite, b) for x, b in zip(xs, bs)]
    codes_ref[row] = packing.pack_pair(*codes) if codec.packed else codes[0]

  codes, scales = _mosaic_gpu_call(kernel, inputs, [(width, codec.code_dtype), (4, jnp.float32)],
                                   interpret, rows_per_step, columns, _segment(width))
  return codes[:, :codec.code_columns(block_len)], scales[:, 0]


def _mosaic_gpu_dequantize(codec, interpret, codes, scales, rows_per_step):
  block_len = codes.shape[1] * 2 if codec.packed else codes.shape[1]
  columns, _, width = _layout(codec, block_len, MOSAIC_GPU_MIN_WIDTH)

  def kernel(row, codes_ref, scale_ref, out_ref):
    scale = scale_ref[row, 0, 0]
    row_codes = codes_ref[row]
    values = packing.unpack_pair(row_codes) if codec.packed else (row_codes,)
    for i, part in enumerate(values):
      segment = out_ref.shape[-1]
      out_ref[row, pl.ds(i * width // segment, width // segment), :] = codec.decode_values(
          part, scale)

  inputs = [_pad_columns(codes, width), jnp.broadcast_to(scales[:, None], (scales.shape[0], 4))]
  (out,) = _mosaic_gpu_call(kernel, inputs, [(columns, jnp.float32)], interpret, rows_per_step,
                            columns, _segment(width))
  return _unarrange(codec, out, block_len, width)


def _kernel(triton_tpu_fn, mosaic_gpu_fn, backend: str, interpret: bool):
  """``*args -> outputs`` of one backend's kernel (``triton``, ``mosaic_gpu``, ``tpu``), compiled
  or, with ``interpret``, interpreted."""
  if backend == "mosaic_gpu":
    return functools.partial(mosaic_gpu_fn, interpret)
  return functools.partial(triton_tpu_fn, "interpret" if interpret else backend)


def _dispatch(kernel_of, reference_fn, supported: bool, interpret: bool | None, gpu: str | None):
  """The kernel per platform (see the module docstring); ``*args -> outputs``.

  ``kernel_of(backend, interpret)``: a backend's kernel; ``gpu``: the GPU backend (default:
  :func:`gpu_kernel`)."""
  gpu = gpu_kernel() if gpu is None else gpu
  # Interpret mode runs the Mosaic GPU body for the codecs it takes, else the Triton and TPU one.
  interpreted = kernel_of(gpu if supported and gpu == "mosaic_gpu" else "triton", True)
  if interpret:
    return interpreted
  elsewhere = reference_fn if interpret is False else interpreted
  if not supported:
    return elsewhere
  compiled = {"tpu": on_every_axis(kernel_of("tpu", False)),
              "cuda": reference_fn if gpu == "reference" else on_every_axis(kernel_of(gpu, False))}
  return lambda *args: jax.lax.platform_dependent(*args, default=elsewhere, **compiled)


@functools.partial(jax.jit, static_argnames=("codec", "interpret", "rows_per_step", "gpu"))
def quantize(x_blocks: jax.Array, bits: jax.Array | None, *, codec, interpret: bool | None,
             rows_per_step: int | None = None, gpu: str | None = None):
  """Pallas quantize: fp32 ``[B, L]`` (+ uint32 bits) to ``(codes [B, C], scales [B] or None)``.

  Jitted (traced once per shape and codec: a model's many same-shaped leaves share the trace).

  Args:
    x_blocks: fp32 ``[B, L]``.
    bits: uint32 ``[B, L]`` for stochastic rounding, else None.
    codec: the codec.
    interpret: True: interpret mode (of the ``gpu`` kernel's body); None / False: compiled on
      cuda and tpu, interpret mode / the jnp reference elsewhere.
    rows_per_step: blocks per grid step (rounded up to a power of 2); default per backend.
    gpu: the kernel on cuda, one of :data:`GPU_KERNELS` or ``reference``; default
      :func:`gpu_kernel`.
  """
  kernel_of = lambda backend, interpret: _kernel(
      lambda b, x, bits: _quantize_kernel(codec, b, x, bits, rows_per_step),
      lambda i, x, bits: _mosaic_gpu_quantize(codec, i, x, bits, rows_per_step),
      backend, interpret)
  reference = lambda x, b: codec.quantize_reference(x, b)
  supported = compiled_supported(codec, x_blocks.shape[1])
  return _dispatch(kernel_of, reference, supported, interpret, gpu)(x_blocks, bits)


@functools.partial(jax.jit, static_argnames=("codec", "interpret", "rows_per_step", "gpu"))
def dequantize(codes: jax.Array, scales: jax.Array | None, *, codec, interpret: bool | None,
               rows_per_step: int | None = None, gpu: str | None = None) -> jax.Array:
  """Pallas dequantize: codes ``[B, C]`` and scales ``[B]`` (or None) to fp32 ``[B, L]`` (see
  :func:`quantize`)."""
  kernel_of = lambda backend, interpret: _kernel(
      lambda b, c, s: _dequantize_kernel(codec, b, c, s, rows_per_step),
      lambda i, c, s: _mosaic_gpu_dequantize(codec, i, c, s, rows_per_step),
      backend, interpret)
  reference = lambda c, s: codec.dequantize_reference(c, s)
  block_len = codes.shape[1] * 2 if codec.packed else codes.shape[1]
  supported = compiled_supported(codec, block_len)
  return _dispatch(kernel_of, reference, supported, interpret, gpu)(codes, scales)
