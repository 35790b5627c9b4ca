"""Model shapes: a frozen dataclass and the named sizes.

`tiny` is for tests, `small` for CPU runs and benchmarks, and the `sdl_*`
presets are the Streaming DiLoCo paper's C4 scaling models (docs/algorithms.md §1.4:
layers L = 6/9/12/15/18/24/36, heads 8..48, d = 64·heads, vocabulary V = 32k) in bfloat16, for
accelerators. The papers name a model by 12·d²·L + V·d (attention 4d², a 4d-wide MLP 8d², one
embedding); here the MLP is a SwiGLU (three d × d_ff matrices) with d_ff = 8d/3 rounded to a
multiple of 64, so the blocks hold the papers' 12·d²·L (within 2%), and the untied output head adds
one more V·d. `param_count` gives the exact count; docs/accelerators.md lists each preset's
parameters, state bytes per device and the mesh it needs.
"""

from __future__ import annotations

import dataclasses

LAYER_LOOPS = ("auto", "scan", "unroll")
ATTENTIONS = ("xla", "dot_product", "cpu_kernel")
REMATS = ("none", "full", "dots")
# Deepest stack "auto" unrolls on CPU: beyond it compile time grows with depth for a shrinking gain.
UNROLL_MAX_LAYERS = 12


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape of a Llama-style decoder.

  Attributes:
    vocab_size: tokens in the vocabulary (256 for the byte tokenizer).
    d_model: width of the residual stream.
    num_layers: transformer blocks, stacked on a leading layer axis.
    num_heads: attention heads; head_dim = d_model // num_heads.
    d_ff: hidden width of the SwiGLU feed-forward.
    max_seq_len: longest sequence the rotary table is built for.
    rope_base: rotary frequency base.
    norm_eps: RMSNorm epsilon.
    dtype: compute dtype of activations ("float32" or "bfloat16"); parameters
      are always float32. The sdl_* presets compute in bfloat16.
    layer_loop: how the forward runs the stacked blocks: "scan" (one `lax.scan`
      body, compile time independent of depth), "unroll" (a Python loop over
      static slices: on CPU XLA then neither zero-fills nor copies the stacked
      per-layer activation and gradient buffers, so a step costs less CPU time,
      docs/performance.md), or "auto": unroll on CPU up to
      `UNROLL_MAX_LAYERS` layers without remat, scan otherwise and on GPU/TPU
      (unmeasured here; scan is what MaxText defaults to there). A `path` forward always
      scans over its layer indices. The arithmetic is the same either way.
    attention: how causal attention is computed: "xla" (batched dots and a
      softmax, every backend; keeps the [B, H, T, T] probabilities for the
      backward), "dot_product" (`jax.nn.dot_product_attention`: cuDNN's fused
      flash attention when lowered for cuda with cuDNN installed, bfloat16,
      head_dim a multiple of 8 up to 128; jax's XLA implementation elsewhere),
      or "cpu_kernel" (one fused C++ kernel per direction,
      `cpu_kernels/attention.py`: CPU, float32, head_dim 16/32/64/128; less CPU
      time per step, docs/performance.md). Same arithmetic up to float32
      rounding.
    remat: what each block keeps for the backward (`jax.checkpoint` around the
      block, scanned or unrolled): "none" (every activation autodiff needs),
      "full" (only the block's input: the whole block is recomputed in the
      backward, one more forward), or "dots" (the outputs of matmuls without
      batch dimensions, i.e. the projections; attention's scores and
      probabilities and the elementwise ops are recomputed; the sdl_* presets'
      setting). Same values up to float32 rounding.
  """

  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 6
  num_heads: int = 4
  d_ff: int = 384
  max_seq_len: int = 256
  rope_base: float = 10_000.0
  norm_eps: float = 1e-5
  dtype: str = "float32"
  layer_loop: str = "auto"
  attention: str = "xla"
  remat: str = "none"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
    if self.d_model % self.num_heads:
      raise ValueError(
          f"model.d_model ({self.d_model}) must be divisible by model.num_heads ({self.num_heads})")
    if (self.d_model // self.num_heads) % 2:
      raise ValueError("model.d_model // model.num_heads must be even for rotary embeddings, got "
                       f"{self.d_model // self.num_heads}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"model.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
    if self.layer_loop not in LAYER_LOOPS:
      raise ValueError(f"model.layer_loop must be one of {LAYER_LOOPS}, got {self.layer_loop!r}")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"model.attention must be one of {ATTENTIONS}, got {self.attention!r}")
    if self.remat not in REMATS:
      raise ValueError(f"model.remat must be one of {REMATS}, got {self.remat!r}")
    if self.attention == "cpu_kernel":
      from lowcomm_jax.cpu_kernels import attention  # pylint: disable=g-import-not-at-top
      attention.check(self.dtype, self.head_dim)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def unrolls_layers(self, backend: str) -> bool:
    """Whether the no-path forward unrolls the layer loop on `backend` ("cpu", "gpu", "tpu")."""
    if self.layer_loop == "auto":
      # with remat, scan: unrolled, XLA:CPU schedules the recomputation early and keeps as much
      # as without it (benchmarks/model_memory.py)
      return backend == "cpu" and self.num_layers <= UNROLL_MAX_LAYERS and self.remat == "none"
    return self.layer_loop == "unroll"


# What the sdl_* presets keep for the backward: at 8 × 2048 tokens per replica in bfloat16 "dots"
# keeps about half the temporaries of "none" (benchmarks/model_memory.py, docs/accelerators.md)
# for one more forward of the attention and elementwise ops only; "full" saves little more.
PAPER_REMAT = "dots"


def _paper_preset(layers: int, heads: int) -> ModelConfig:
  d_model = 64 * heads
  d_ff = 64 * round(8 * d_model / 3 / 64)  # 3·d·d_ff ≈ 8d², the papers' MLP
  return ModelConfig(vocab_size=32_000, d_model=d_model, num_layers=layers, num_heads=heads,
                     d_ff=d_ff, max_seq_len=2048, dtype="bfloat16", remat=PAPER_REMAT)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64, max_seq_len=128),
    "small": ModelConfig(d_model=128, num_layers=6, num_heads=4, d_ff=384, max_seq_len=256),
    # Streaming DiLoCo C4 scaling presets (docs/algorithms.md §1.4), for accelerators.
    "sdl_35m": _paper_preset(6, 8),
    "sdl_100m": _paper_preset(9, 12),
    "sdl_200m": _paper_preset(12, 16),
    "sdl_300m": _paper_preset(15, 20),
    "sdl_500m": _paper_preset(18, 24),
    "sdl_1b": _paper_preset(24, 32),
    "sdl_4b": _paper_preset(36, 48),
}


def get_model_config(name: str, **overrides) -> ModelConfig:
  """Returns the named preset with `overrides` applied."""
  if name not in PRESETS:
    raise ValueError(f"model.size must be one of {sorted(PRESETS)}, got {name!r}")
  return dataclasses.replace(PRESETS[name], **overrides)


def param_count(cfg: ModelConfig, include_embedding: bool = True) -> int:
  """Parameters of the decoder, counted from the shapes.

  Per block: two RMSNorm scales (2d), q/k/v/o projections (4d²) and the SwiGLU
  gate, up and down projections (3·d·d_ff). Outside the blocks: the token
  embedding (V·d), the final norm (d) and an untied output head (d·V).
  """
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  per_block = 2 * d + 4 * d * d + 3 * d * f
  total = cfg.num_layers * per_block + d + d * v
  if include_embedding:
    total += v * d
  return total


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> float:
  """Matmul FLOPs per token, counted by hand (2 FLOPs per multiply-add).

  Forward, per token: 2 × (4d² + 3·d·d_ff) per block for the projections,
  2·T·d for the scores QKᵀ and 2·T·d for the weighted sum of values per block
  (causal masking not discounted, as in Kaplan et al.), and 2·d·V for the head.
  The embedding lookup is a gather (no FLOPs). Training costs 3× the forward
  (backward = 2× forward).
  """
  d, f, v, layers = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.num_layers
  forward = layers * (2 * (4 * d * d + 3 * d * f) + 4 * seq_len * d) + 2 * d * v
  return float(3 * forward if training else forward)
