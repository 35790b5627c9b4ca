"""A Llama-style decoder in Flax NNX: RMSNorm, rotary positions, SwiGLU, causal attention.

The transformer blocks are stacked on a leading layer axis (one `Block` made by
`nnx.vmap`), so that fragments (Streaming DiLoCo) and pipeline paths
(SkipPipe, NoLoCo) can index layers. `Decoder.__call__` takes an optional
`path`: a sequence of layer indices run in the given order. A path that omits
a layer gives that layer no gradient; a path that swaps two layers runs them
swapped. The default (no path) runs the stacked blocks in order, unrolled or
scanned as `ModelConfig.layer_loop` says.

Gradients are autodiff's on every platform, so a program traced and tested on CPU is the one
lowered for cuda or tpu. `ModelConfig.remat` wraps each block in `jax.checkpoint`.

Every parameter carries `logical_axes` metadata (names such as "embed",
"mlp", "heads", "vocab"); `lowcomm_jax.sharding` maps them to mesh axes.
Stacked block parameters get the logical axis "layers" in front.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from lowcomm_jax.models.attention import dot_product_attention
from lowcomm_jax.models.config import ModelConfig

_INIT_STD = 0.02


def _param(rngs: nnx.Rngs, shape: Sequence[int], axes: tuple[str, ...], std: float) -> nnx.Param:
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), logical_axes=axes)


class RMSNorm(nnx.Module):
  """x / rms(x) · scale, computed in float32."""

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=("norm",))
    self.eps = eps

  def __call__(self, x_BxTxD):
    return rms_norm(self.eps, x_BxTxD, self.scale[...])


def rms_norm(eps: float, x, scale):
  """x · r · scale with r = 1 / √(mean(x²) + eps) over the last axis, in float32, cast back to x's
  dtype."""
  x32 = x.astype(jnp.float32)
  inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * inv_rms * scale).astype(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
  """cos and sin tables of shape [T, head_dim // 2] for rotary positions.

  Computed when the step is traced, so they enter the compiled program as constants: traced, XLA
  fused the cos and sin into every rotary fusion and evaluated them once per element of q and k
  (B·H times per table entry, in the forward and again in the backward), a visible share of the
  `small` model's step (benchmarks/results/README.md, 2026-11-23, pass 2). Same XLA ops, so the same
  values.
  """
  with jax.ensure_compile_time_eval():
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_TxK = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles_TxK), jnp.sin(angles_TxK)


def apply_rotary(x, cos, sin):
  """Rotates pairs (first half, second half) of each head's features by position.

  `cos` and `sin` broadcast against x's halves: [1, T, 1, K/2] for x [B, T, H, K], or
  [1, 1, T, K/2] for x [B, H, T, K]. Computed in float32.
  """
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _causal_softmax(q_BxHxTxK, k_BxHxSxK):
  """Softmax over s of the scaled, causally masked scores q·k / √K, in float32."""
  scores_BxHxTxS = jnp.einsum("bhtk,bhsk->bhts", q_BxHxTxK, k_BxHxSxK).astype(jnp.float32)
  scores_BxHxTxS = scores_BxHxTxS / q_BxHxTxK.shape[-1] ** 0.5
  t, s = scores_BxHxTxS.shape[-2:]
  causal_TxS = jnp.tril(jnp.ones((t, s), bool))
  return jax.nn.softmax(jnp.where(causal_TxS, scores_BxHxTxS, -1e30), axis=-1)


def causal_attention(q_BxHxTxK, k_BxHxSxK, v_BxHxSxK):
  """softmax(q·kᵀ / √K, causal) · v, heads before time; probabilities in the inputs' dtype."""
  probs_BxHxTxS = _causal_softmax(q_BxHxTxK, k_BxHxSxK).astype(v_BxHxSxK.dtype)
  return jnp.einsum("bhts,bhsk->bhtk", probs_BxHxTxS, v_BxHxSxK)


def head_logits(x_BxTxD, head_DxV, dtype):
  """The output head's float32 logits from the final norm's output (the Decoder and SkipPipe's
  pipeline stages share it)."""
  return jnp.einsum("btd,dv->btv", x_BxTxD, head_DxV.astype(dtype)).astype(jnp.float32)


class Attention(nnx.Module):
  """Causal multi-head self-attention with rotary positions."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h, k = cfg.d_model, cfg.num_heads, cfg.head_dim
    # keeps the residual stream's scale with depth
    out_std = _INIT_STD / (2 * cfg.num_layers) ** 0.5
    self.wq = _param(rngs, (d, h, k), ("embed", "heads", "head_dim"), _INIT_STD)
    self.wk = _param(rngs, (d, h, k), ("embed", "heads", "head_dim"), _INIT_STD)
    self.wv = _param(rngs, (d, h, k), ("embed", "heads", "head_dim"), _INIT_STD)
    self.wo = _param(rngs, (h, k, d), ("heads", "head_dim", "embed"), out_std)
    self.dtype = jnp.dtype(cfg.dtype)
    self.attention = cfg.attention

  def __call__(self, x_BxTxD, cos, sin):
    dt = self.dtype
    time_first = self.attention != "xla"
    # q, k, v are projected straight into the layout attention takes, so XLA transposes none of them
    # (nor their gradients): the XLA path's batched matmuls batch over [B, H, T, K]; the CPU kernel
    # and jax.nn.dot_product_attention read the projections' own [B, T, H, K].
    heads = "bthk" if time_first else "bhtk"
    project_heads = lambda w: jnp.einsum(f"btd,dhk->{heads}", x_BxTxD, w[...].astype(dt))
    cos, sin = (
      (cos[None, :, None], sin[None, :, None]) if time_first else (cos[None, None], sin[None, None])
    )
    q = apply_rotary(project_heads(self.wq), cos, sin)
    k = apply_rotary(project_heads(self.wk), cos, sin)
    if self.attention == "cpu_kernel":
      from lowcomm_jax.cpu_kernels import attention as cpu_attention  # pylint: disable=g-import-not-at-top
      attend = cpu_attention.causal_attention
    elif self.attention == "dot_product":
      attend = dot_product_attention
    else:
      attend = causal_attention
    out = attend(q, k, project_heads(self.wv))
    return jnp.einsum(f"{heads},hkd->btd", out, self.wo[...].astype(dt))


def gated_silu(gate_up_Nx2xF):
  """silu(gate) · up for gate, up = gate_up[..., 0, :], gate_up[..., 1, :]."""
  gate, up = gate_up_Nx2xF[..., 0, :], gate_up_Nx2xF[..., 1, :]
  return gate * jax.nn.sigmoid(gate) * up


class SwiGLU(nnx.Module):
  """down(silu(gate(x)) · up(x)).

  gate and up are one matmul against the two weights stacked on a new axis ([D, 2, F]: the same
  sharding along F as each weight): one [B·T, 2F] product and, in the backward, one input-gradient
  matmul and one weight-gradient matmul for both, instead of two each and a sum: fewer, larger
  matmuls (benchmarks/results/README.md, 2026-11-23, pass 2); the same arithmetic
  per output element.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.d_ff
    self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), _INIT_STD)
    self.w_up = _param(rngs, (d, f), ("embed", "mlp"), _INIT_STD)
    self.w_down = _param(rngs, (f, d), ("mlp", "embed"), _INIT_STD / (2 * cfg.num_layers) ** 0.5)
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x_BxTxD):
    dt = self.dtype
    w_Dx2xF = jnp.stack([self.w_gate[...], self.w_up[...]], axis=1).astype(dt)
    gate_up_BxTx2xF = jnp.einsum("btd,dgf->btgf", x_BxTxD, w_Dx2xF)
    return gated_silu(gate_up_BxTx2xF) @ self.w_down[...].astype(dt)


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.mlp = SwiGLU(cfg, rngs)

  def __call__(self, x_BxTxD, cos, sin):
    x_BxTxD = x_BxTxD + self.attn(self.attn_norm(x_BxTxD), cos, sin)
    return x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD))


_REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def block_fn(block_def, remat: str = "none", scanned: bool = False):
  """(layer_state, x, cos, sin) -> the block's output, under `jax.checkpoint` unless remat="none".

  In a scan body CSE cannot merge the recomputation with the forward (each iteration is its own
  call), so `prevent_cse` is off there, as `jax.checkpoint` advises.
  """
  def run(layer_state, x, cos, sin):
    return nnx.merge(block_def, layer_state)(x, cos, sin)
  if remat == "none":
    return run
  return jax.checkpoint(run, policy=_REMAT_POLICIES[remat], prevent_cse=not scanned)


def run_blocks_scanned(block_def, blocks_state, x_BxTxD, cos, sin, remat="none"):
  """The stacked blocks in order, as one `lax.scan` over the leading layer axis."""
  run = block_fn(block_def, remat, scanned=True)
  return jax.lax.scan(lambda x, layer_state: (run(layer_state, x, cos, sin), None), x_BxTxD,
                      blocks_state)[0]


def run_blocks_unrolled(block_def, blocks_state, x_BxTxD, cos, sin, remat="none"):
  """The stacked blocks in order, one static slice each: the same arithmetic as the scan."""
  run = block_fn(block_def, remat)
  for layer in range(jax.tree.leaves(blocks_state)[0].shape[0]):
    layer_state = jax.tree.map(lambda a, i=layer: a[i], blocks_state)
    x_BxTxD = run(layer_state, x_BxTxD, cos, sin)
  return x_BxTxD


class Decoder(nnx.Module):
  """Token embedding, `num_layers` stacked blocks, final norm and an untied head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1.0)

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return Block(cfg, rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), _INIT_STD)

  def __call__(self, tokens_BxT, path=None):
    """Logits [B, T, V] for int tokens [B, T].

    Args:
      tokens_BxT: int token ids.
      path: None to run every block in order, or a 1-D int sequence of layer
        indices run in that order (repeats allowed; omitted layers are skipped).
    """
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    t = tokens_BxT.shape[1]
    if t > cfg.max_seq_len:
      raise ValueError(f"sequence length {t} exceeds model.max_seq_len={cfg.max_seq_len}")
    cos, sin = rotary_tables(t, cfg.head_dim, cfg.rope_base)
    x_BxTxD = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(dt)
    graphdef, blocks_state = nnx.split(self.blocks)
    if path is None and cfg.unrolls_layers(jax.default_backend()):
      x_BxTxD = run_blocks_unrolled(graphdef, blocks_state, x_BxTxD, cos, sin, cfg.remat)
    elif path is None:
      x_BxTxD = run_blocks_scanned(graphdef, blocks_state, x_BxTxD, cos, sin, cfg.remat)
    else:
      run = block_fn(graphdef, cfg.remat, scanned=True)
      def run_indexed(x, layer_index):
        # Gathering one layer's slice: a skipped layer's slice is never read, so it gets no
        # gradient.
        layer_state = jax.tree.map(lambda a: a[layer_index], blocks_state)
        return run(layer_state, x, cos, sin), None
      x_BxTxD, _ = jax.lax.scan(run_indexed, x_BxTxD, jnp.asarray(path, jnp.int32))
    return head_logits(self.final_norm(x_BxTxD), self.head[...], dt)


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_params(cfg: ModelConfig, seed: int) -> dict:
  """A fresh Decoder's parameters as a pure dict (float32), from `nnx.Rngs(seed)`.

  Jitted: one compiled program instead of hundreds of eager ops, which take
  seconds to dispatch on CPU. Unsharded; the Trainer builds its own with the
  layout's shardings.
  """
  return nnx.to_pure_dict(nnx.state(Decoder(cfg, nnx.Rngs(seed)), nnx.Param))


def logical_axes(model: Decoder) -> dict[str, tuple[str, ...]]:
  """Logical axis names of every parameter, keyed by its path ("blocks/attn/wq").

  Stacked block parameters get "layers" in front of their per-block axes.
  """
  axes_by_path = {}
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name = "/".join(str(k) for k in path)
    axes = tuple(variable.get_metadata()["logical_axes"])
    if path[0] == "blocks":
      axes = ("layers",) + axes
    if len(axes) != len(variable.get_value().shape):
      raise ValueError(f"parameter {name} has {len(variable.get_value().shape)} dims but logical "
                       f"axes {axes}")
    axes_by_path[name] = axes
  return axes_by_path


def path_name(key_path) -> str:
  """"blocks/attn/wq" for a jax key path into a pure-dict parameter tree."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)
