"""The codec interface: blocks, encoded values, wire bytes, finiteness checks.

A codec turns an fp32 tensor into what travels on the wire and back. Every
codec here works on the same layout: the tensor is flattened and cut into
``num_blocks`` blocks of ``block_len`` values (see :meth:`Codec.layout`), the
last block padded with zeros, and each block is quantized on its own. The
encoded value is an :class:`EncodedTensor`: the codes, one fp32 scale per
block (for the scaled codecs) and the original shape as static metadata.

``block_size`` is the *largest* block: a tensor of ``n`` values is cut into
``ceil(n / block_size)`` blocks of equal length (rounded up to an even number
for the 4-bit codecs, so that two codes share a byte). Equal blocks keep the
padding to a few values per block instead of up to a whole block, and a
``block_size`` at least as large as the tensor gives one block, that is
per-tensor scaling.

NaN and inf policy (scaled codecs): a block that holds any NaN or ±inf gets
the scale NaN and all-zero codes, so every value of that block decodes to NaN
and the damage stays visible downstream instead of turning into finite
garbage. ``bf16`` and ``fp32`` carry NaN and ±inf per value. To refuse a step
before anything is sent, call :func:`check_finite` on the host (or
:func:`all_finite` inside ``jit`` and act on the flag).

Denormals: XLA on CPU flushes float32 denormals to zero inside compiled code,
so values below the smallest normal float32 (2^-126 ≈ 1.2e-38) may decode to
zero, and a block whose scale would be denormal is coded as all zeros. The
absolute error this adds is below ``grid_max · 2^-126``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax.codecs import kernels, packing
from lowcomm_jax.codecs.scales import scales_from_absmax

__all__ = [
    "ROUNDING_MODES",
    "Codec",
    "EncodedTensor",
    "NonFiniteError",
    "all_finite",
    "check_finite",
    "block_scales",
    "blocks_from_flat",
    "flat_from_blocks",
    "uniform_from_bits",
    "KERNEL_MODES",
    "kernel_choice",
    "kernel_options",
]

ROUNDING_MODES = ("nearest", "stochastic")
# Which implementation encodes and decodes on the wire path (config key outer.codec_kernels).
KERNEL_MODES = ("auto", "pallas", "pallas_mosaic_gpu", "pallas_triton", "reference")
# The GPU kernel a forced mode names.
_FORCED_GPU = {"pallas_mosaic_gpu": "mosaic_gpu", "pallas_triton": "triton"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EncodedTensor:
  """One tensor as it travels on the wire.

  Attributes:
    codes: the quantized values, ``[num_blocks, code_columns]``; uint8 with
      two 4-bit codes per byte, int8, bfloat16 or float32 depending on the
      codec.
    scales: float32 ``[num_blocks]``, one absmax-derived scale per block, or
      ``None`` for codecs without scales (bf16, fp32).
    shape: the original tensor's shape (static: not an array, not sent).
  """

  codes: jax.Array
  scales: jax.Array | None
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

  @property
  def payload_bytes(self) -> int:
    """Bytes of the arrays held (codes plus scales): what a send moves."""
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(self))


def _platform_of(platform: str | None) -> str:
  """``cuda``, ``tpu``, ``cpu``, … of a platform name, ``jax.default_backend()`` by default (which
  names NVIDIA GPUs ``gpu``)."""
  platform = jax.default_backend() if platform is None else platform
  if platform == "gpu":
    version = getattr(jax.devices()[0].client, "platform_version", "") or ""
    return "rocm" if "rocm" in version.lower() else "cuda"
  return platform


def kernel_options(mode: str, codec: "Codec | None" = None,
                   platform: str | None = None, device=None) -> dict[str, Any]:
  """The ``encode_blocks``/``decode_blocks`` options of a kernel mode.

  ``reference``: the jnp reference. ``pallas``: the Pallas kernels, compiled on GPU (the kernel
  :func:`lowcomm_jax.codecs.kernels.gpu_kernel` picks for the installed JAX and the GPU: Mosaic GPU,
  else Triton) and TPU (Mosaic), interpreted on CPU (slow: for tests; bit-identical to the
  reference). ``pallas_mosaic_gpu`` / ``pallas_triton``: ``pallas`` with that GPU kernel (on CPU,
  its body interpreted). ``auto``: the compiled kernels where the program is lowered for GPU or
  TPU, the reference elsewhere (and for codecs or blocks without a compiled kernel:
  ``kernels.compiled_supported``).

  Args:
    mode: one of :data:`KERNEL_MODES`.
    codec: when given, a ``pallas*`` mode is checked against it on ``platform``.
    platform: where the program runs (default: ``jax.default_backend()``).
    device: the GPU it runs on (default: this host's first GPU, on a GPU host).

  Raises:
    ValueError: naming ``outer.codec_kernels`` and the allowed values, or a ``pallas*`` mode
      where it cannot compile.
  """
  if mode not in KERNEL_MODES:
    raise ValueError(f"outer.codec_kernels must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
  platform = _platform_of(platform)
  gpu = _FORCED_GPU.get(mode)
  if mode.startswith("pallas") and platform != "cpu":
    if platform not in kernels.COMPILED_PLATFORMS or (gpu and platform != "cuda"):
      where = "cuda" if gpu else ", ".join(kernels.COMPILED_PLATFORMS)
      raise ValueError(
          f"outer.codec_kernels={mode} has no compiled kernel on {platform} (only on {where}); "
          f"use outer.codec_kernels=auto or reference")
    if platform == "cuda":
      refusal = kernels.gpu_kernel_refusal(gpu, device)
      if refusal:
        raise ValueError(f"outer.codec_kernels={mode}: {refusal}; use outer.codec_kernels=auto "
                         f"or reference")
    if codec is not None and not kernels.compiled_supported(codec):
      raise ValueError(
          f"outer.codec_kernels={mode}: codec {codec.name!r} with block size {codec.block_size} "
          f"has no compiled kernel (scaled codecs with blocks of at most "
          f"{kernels.MAX_COMPILED_COLUMNS} values do); use outer.codec_kernels=auto or reference")
  if mode == "reference":
    return dict(use_pallas=False, interpret=None)
  return dict(use_pallas=True, interpret=False if mode == "auto" else None, gpu=gpu)


def kernel_choice(mode: str, codec: "Codec | None", platform: str | None = None,
                  device=None) -> str:
  """What encodes and decodes on the wire under ``mode`` (checked as :func:`kernel_options`):
  ``pallas_mosaic_gpu``, ``pallas_triton``, ``pallas_tpu``, ``pallas_interpret_mosaic_gpu`` or
  ``pallas_interpret_triton`` (interpret mode of that body, on CPU), or ``reference``."""
  options = kernel_options(mode, codec, platform, device)
  platform = _platform_of(platform)
  if not options["use_pallas"] or codec is None or not kernels.compiled_supported(codec):
    return "reference"
  gpu = options["gpu"] or kernels.gpu_kernel(device)
  if platform == "tpu":
    return "pallas_tpu"
  if platform == "cuda":
    return "reference" if gpu == "reference" else f"pallas_{gpu}"
  if options["interpret"] is False:  # auto, where no compiled kernel exists
    return "reference"
  return f"pallas_interpret_{'triton' if gpu == 'reference' else gpu}"


def uniform_from_bits(bits: jax.Array) -> jax.Array:
  """Uniform floats in [0, 1) from uint32 random bits (24 bits of precision).

  Stochastic rounding takes its randomness as raw bits drawn outside the
  kernels, so the Pallas kernel and the jnp reference see the same numbers.
  """
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def block_scales(x: jax.Array, grid_max: float):
  """Absmax scale of each row of ``x`` (``[R, L]``) for a grid topping at ``grid_max``.

  Returns ``(scale, divisor, finite)``, each ``[R, 1]``: see :func:`scales_from_absmax`.
  """
  return scales_from_absmax(jnp.max(jnp.abs(x), axis=1, keepdims=True), grid_max)


def blocks_from_flat(flat: jax.Array, num_blocks: int, block_len: int) -> jax.Array:
  """Pads a 1-D array with zeros and reshapes it to ``[num_blocks, block_len]``."""
  padding = num_blocks * block_len - flat.shape[0]
  return jnp.pad(flat, (0, padding)).reshape(num_blocks, block_len)


def flat_from_blocks(blocks: jax.Array, num_elements: int) -> jax.Array:
  """Inverse of :func:`blocks_from_flat`: drops the padding."""
  return blocks.reshape(-1)[:num_elements]


@dataclasses.dataclass(frozen=True)
class Codec(abc.ABC):
  """A wire format: encode/decode a tensor and count its bytes.

  Subclasses implement the block-level reference and Pallas functions; this
  class does the layout, padding and dispatch. Codecs are frozen dataclasses,
  hashable, so they can be static arguments of ``jax.jit``.

  Attributes:
    block_size: the largest number of values sharing one scale.
    rounding: ``"nearest"`` (ties to the even code) or ``"stochastic"``
      (unbiased; ``encode`` then needs a PRNG key).
  """

  block_size: int = 1024
  rounding: str = "nearest"

  name: ClassVar[str]
  bits_per_value: ClassVar[int]
  # Whether each block carries an fp32 scale on the wire.
  has_scales: ClassVar[bool] = True
  # Whether the layout ignores block_size and keeps one unpadded block.
  single_block: ClassVar[bool] = False

  def __post_init__(self):
    if (
      isinstance(self.block_size, bool)
      or not isinstance(self.block_size, int)
      or self.block_size < 2
    ):
      raise ValueError(
          f"block_size: must be an integer >= 2 (values per scale), got {self.block_size!r}")
    if self.rounding not in ROUNDING_MODES:
      raise ValueError(
          f"rounding: must be one of {', '.join(ROUNDING_MODES)}, got {self.rounding!r}")

  # ---------------------------------------------------------------- layout
  def layout(self, num_elements: int) -> tuple[int, int]:
    """Returns ``(num_blocks, block_len)`` for a tensor of that many values."""
    if num_elements == 0:
      return 0, 2
    if self.single_block:
      return 1, num_elements
    num_blocks = math.ceil(num_elements / self.block_size)
    block_len = math.ceil(num_elements / num_blocks)
    if self.bits_per_value == 4:
      block_len += block_len % 2
    return num_blocks, block_len

  def code_columns(self, block_len: int) -> int:
    """Columns of the codes array for one block (two 4-bit codes share a byte)."""
    return block_len // 2 if self.bits_per_value == 4 else block_len

  def wire_bytes(self, num_elements: int) -> int:
    """Bytes on the wire for one tensor of ``num_elements`` values.

    Exactly the payload of the :class:`EncodedTensor`: the packed codes of
    every (padded) block plus 4 bytes per scale. Static: plain Python ints, so
    the ledger can call it at trace time.
    """
    num_blocks, block_len = self.layout(int(num_elements))
    scale_bytes = 4 * num_blocks if self.has_scales else 0
    return num_blocks * (block_len * self.bits_per_value // 8) + scale_bytes

  def bits_per_parameter(self, num_elements: int) -> float:
    """Wire bits per value, scales and padding included."""
    return 8.0 * self.wire_bytes(num_elements) / max(int(num_elements), 1)

  # ------------------------------------------------------------- block API
  # Each codec module supplies the math of values (encode_values, decode_values); the jnp
  # reference applies it to whole blocks at once and the Pallas kernels to tiles of blocks whose
  # 4-bit halves they read and write through ref slices (lowcomm_jax.codecs.kernels).
  code_dtype: ClassVar[Any]
  # The top of the grid: a block's scale is its absmax / grid_max (scaled codecs).
  grid_max: ClassVar[float] = 1.0

  @abc.abstractmethod
  def encode_values(self, x: jax.Array, divisor: jax.Array | None, finite: jax.Array | None,
                    bits: jax.Array | None) -> jax.Array:
    """fp32 values ``[R, n]`` of blocks with divisor and finiteness ``[R, 1]`` (None without
    scales), plus uint32 ``bits`` for stochastic rounding, to unpacked codes ``[R, n]`` (int32
    for the 4-bit codecs, ``code_dtype`` otherwise)."""

  @abc.abstractmethod
  def decode_values(self, codes: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Unpacked codes ``[R, n]`` (+ scales ``[R, 1]``) to fp32 ``[R, n]``."""

  @property
  def packed(self) -> bool:
    """Whether two codes share a byte (the 4-bit codecs)."""
    return self.bits_per_value == 4

  def quantize_tile(self, x: jax.Array, bits: jax.Array | None):
    """fp32 ``[R, L]`` (+ uint32 bits) to codes ``[R, C]`` and, if scaled, scales ``[R, 1]``."""
    scale = divisor = finite = None
    if self.has_scales:
      scale, divisor, finite = block_scales(x, self.grid_max)
    codes = self.encode_values(x, divisor, finite, bits)
    codes = packing.pack_nibbles(codes) if self.packed else codes
    return (codes, scale) if self.has_scales else codes

  def dequantize_tile(self, codes: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Codes ``[R, C]`` (+ scales ``[R, 1]``) to fp32 ``[R, L]``."""
    return self.decode_values(packing.unpack_nibbles(codes) if self.packed else codes, scale)

  def quantize_reference(self, x_blocks: jax.Array, bits: jax.Array | None):
    """jnp reference: fp32 ``[B, L]`` to ``(codes [B, C], scales [B] or None)``."""
    if not self.has_scales:
      return self.quantize_tile(x_blocks, bits), None
    codes, scales = self.quantize_tile(x_blocks, bits)
    return codes, scales[:, 0]

  def dequantize_reference(self, codes: jax.Array, scales: jax.Array | None) -> jax.Array:
    """jnp reference: codes (+ scales ``[B]``) to fp32 ``[B, L]``."""
    return self.dequantize_tile(codes, None if scales is None else scales[:, None])

  def random_bits(self, key: jax.Array | None, shape: tuple[int, ...]) -> jax.Array | None:
    """The uint32 bits stochastic rounding consumes (``None`` when rounding to nearest)."""
    if self.rounding == "nearest":
      return None
    if key is None:
      raise ValueError(
          f"rounding: codec {self.name!r} uses rounding='stochastic', which needs a PRNG "
          "key: pass key=jax.random.key(...)")
    return jax.random.bits(key, shape, jnp.uint32)

  def encode_blocks(self, x_blocks: jax.Array, key: jax.Array | None = None, *,
                    use_pallas: bool = False, interpret: bool | None = None,
                    rows_per_step: int | None = None, gpu: str | None = None):
    """Quantizes fp32 blocks ``[B, L]``; returns ``(codes, scales or None)``.

    With ``use_pallas``: ``interpret=True`` runs the Pallas kernel in interpret mode; otherwise
    compiled on GPU and TPU, and elsewhere interpreted (``None``) or the jnp reference
    (``False``); ``gpu``: the GPU kernel (``mosaic_gpu``, ``triton``, ``reference``; default
    ``kernels.gpu_kernel()``), see :mod:`lowcomm_jax.codecs.kernels`.
    """
    x_blocks = x_blocks.astype(jnp.float32)
    bits = self.random_bits(key, x_blocks.shape)
    if use_pallas and x_blocks.size:
      return kernels.quantize(x_blocks, bits, codec=self, interpret=interpret,
                              rows_per_step=rows_per_step, gpu=gpu)
    return self.quantize_reference(x_blocks, bits)

  def decode_blocks(self, codes: jax.Array, scales: jax.Array | None, *,
                    use_pallas: bool = False, interpret: bool | None = None,
                    rows_per_step: int | None = None, gpu: str | None = None) -> jax.Array:
    """Dequantizes to fp32 blocks ``[B, L]`` (options as :meth:`encode_blocks`)."""
    if use_pallas and codes.size:
      return kernels.dequantize(codes, scales, codec=self, interpret=interpret,
                                rows_per_step=rows_per_step, gpu=gpu)
    return self.dequantize_reference(codes, scales)

  # ------------------------------------------------------------ tensor API
  def encode(self, x: jax.Array, key: jax.Array | None = None, *, use_pallas: bool = False,
             interpret: bool | None = None, rows_per_step: int | None = None,
             gpu: str | None = None) -> EncodedTensor:
    """Encodes a tensor of any shape and size.

    Args:
      x: the tensor (any float dtype; quantized from its fp32 value).
      key: PRNG key, required with ``rounding="stochastic"``.
      use_pallas: run the Pallas kernel instead of the jnp reference.
      interpret: True: Pallas interpret mode; None: compiled on GPU/TPU, interpreted elsewhere;
        False: compiled on GPU/TPU, the jnp reference elsewhere.
      rows_per_step: blocks per Pallas grid step, rounded up to a power of 2
        (default: per backend, ``kernels.TILE_VALUES``).
      gpu: the GPU kernel (``mosaic_gpu``, ``triton``, ``reference``; default
        ``kernels.gpu_kernel()``), also the kernel body interpret mode runs.

    Returns:
      The :class:`EncodedTensor`.
    """
    x = jnp.asarray(x)
    num_blocks, block_len = self.layout(x.size)
    x_blocks = blocks_from_flat(x.reshape(-1).astype(jnp.float32), num_blocks, block_len)
    codes, scales = self.encode_blocks(x_blocks, key, use_pallas=use_pallas, interpret=interpret,
                                       rows_per_step=rows_per_step, gpu=gpu)
    return EncodedTensor(codes=codes, scales=scales, shape=tuple(x.shape))

  def decode(self, encoded: EncodedTensor, *, use_pallas: bool = False,
             interpret: bool | None = None, rows_per_step: int | None = None,
             gpu: str | None = None) -> jax.Array:
    """Decodes to a float32 tensor of the original shape."""
    num_elements = math.prod(encoded.shape)
    x_blocks = self.decode_blocks(encoded.codes, encoded.scales, use_pallas=use_pallas,
                                  interpret=interpret, rows_per_step=rows_per_step, gpu=gpu)
    return flat_from_blocks(x_blocks, num_elements).reshape(encoded.shape)

  def roundtrip(self, x: jax.Array, key: jax.Array | None = None, *, use_pallas: bool = False,
                interpret: bool | None = None, rows_per_step: int | None = None,
                gpu: str | None = None) -> jax.Array:
    """``decode(encode(x))``: what the receiver sees (float32, shape of ``x``)."""
    options = dict(use_pallas=use_pallas, interpret=interpret, rows_per_step=rows_per_step,
                   gpu=gpu)
    return self.decode(self.encode(x, key, **options), **options)


class NonFiniteError(ValueError):
  """An outer gradient (or other payload) holds NaN or inf."""


def all_finite(tree: Any) -> jax.Array:
  """Scalar bool: every value of every leaf is finite (usable inside ``jit``)."""
  leaves = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def check_finite(tree: Any, name: str) -> None:
  """Raises :class:`NonFiniteError` naming ``name`` if any value is NaN or inf.

  Host-side (it reads the values): call it on a fragment's outer gradient
  before the compressed mean to refuse the step.

  Args:
    tree: an array or pytree of arrays.
    name: what the tree is, e.g. ``"fragment 3"``; it appears in the error.
  """
  bad = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      continue
    values = np.asarray(leaf, dtype=np.float32)
    num_nan = int(np.isnan(values).sum())
    num_inf = int(np.isinf(values).sum())
    if num_nan or num_inf:
      bad.append(f"{jax.tree_util.keystr(path) or '<array>'}: {num_nan} NaN, {num_inf} inf "
                 f"of {values.size} values")
  if bad:
    raise NonFiniteError(f"{name}: non-finite values, refusing to send them: " + "; ".join(bad))
