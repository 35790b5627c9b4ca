"""Codecs by name: the ``codec`` option of the DiLoCo family's configs."""

from __future__ import annotations

from lowcomm_jax.codecs import base, float4, integer, passthrough

__all__ = ["CODECS", "get_codec"]

CODECS: dict[str, type[base.Codec]] = {
    codec_class.name: codec_class
    for codec_class in (float4.E3M0, float4.E2M1, integer.INT4, integer.INT8,
                        passthrough.BF16, passthrough.FP32)
}


def get_codec(name: str, block_size: int = 1024, rounding: str = "nearest") -> base.Codec:
  """Returns the codec called ``name``.

  Args:
    name: one of ``e3m0``, ``e2m1``, ``int4``, ``int8``, ``bf16``, ``fp32``.
    block_size: the largest number of values sharing one absmax scale (a
      value at least the tensor's size gives per-tensor scaling); ignored by
      ``bf16`` and ``fp32``.
    rounding: ``"nearest"`` (default) or ``"stochastic"``.

  Returns:
    A frozen, hashable :class:`~lowcomm_jax.codecs.base.Codec`.

  Raises:
    ValueError: naming the option (``codec``, ``block_size`` or
      ``rounding``) and the allowed values.
  """
  if name not in CODECS:
    raise ValueError(f"codec: unknown codec {name!r}; allowed: {', '.join(CODECS)}")
  return CODECS[name](block_size=block_size, rounding=rounding)
