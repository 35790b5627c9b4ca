"""Models: a Flax NNX Llama-style decoder with stacked blocks and a path forward."""

from lowcomm_jax.models.config import (
  PRESETS,
  ModelConfig,
  flops_per_token,
  get_model_config,
  param_count,
)
from lowcomm_jax.models.llama import Decoder, logical_axes

__all__ = ["PRESETS", "ModelConfig", "Decoder", "flops_per_token", "get_model_config",
           "logical_axes",
           "param_count"]
