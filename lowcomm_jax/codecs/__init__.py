"""Wire formats for outer gradients: 4-bit floats and integers, int8, bf16, fp32.

Encode and decode only; the compressed mean that sends them over the replica axis is
`lowcomm_jax.comm.compressed_mean`.

Example:
  >>> import jax.numpy as jnp
  >>> codec = get_codec("e3m0", block_size=4)
  >>> codec.roundtrip(jnp.array([1.0, -0.5, 0.3, 0.0])).tolist()
  [1.0, -0.5, 0.25, 0.0]
  >>> codec.wire_bytes(1 << 20)  # 4 bits per value + one fp32 scale per block
  1572864
"""

from lowcomm_jax.codecs.base import (
    KERNEL_MODES,
    Codec,
    EncodedTensor,
    NonFiniteError,
    all_finite,
    check_finite,
    kernel_choice,
    kernel_options,
)
from lowcomm_jax.codecs.error_feedback import (
    ErrorFeedbackState,
    error_feedback_roundtrip,
    init_error_feedback,
    with_error_feedback,
)
from lowcomm_jax.codecs.float4 import E2M1, E3M0
from lowcomm_jax.codecs.integer import INT4, INT8
from lowcomm_jax.codecs.passthrough import BF16, FP32
from lowcomm_jax.codecs.registry import CODECS, get_codec
from lowcomm_jax.codecs.topk import SparseLayout, TopKCompressor

__all__ = [
    "Codec",
    "EncodedTensor",
    "NonFiniteError",
    "all_finite",
    "check_finite",
    "KERNEL_MODES",
    "kernel_choice",
    "kernel_options",
    "ErrorFeedbackState",
    "error_feedback_roundtrip",
    "init_error_feedback",
    "with_error_feedback",
    "E2M1",
    "E3M0",
    "INT4",
    "INT8",
    "BF16",
    "FP32",
    "CODECS",
    "get_codec",
    "SparseLayout",
    "TopKCompressor",
]
