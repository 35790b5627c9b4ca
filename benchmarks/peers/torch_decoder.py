"""Our Llama-style decoder written in PyTorch, for timing torch-based peers on the same model.

Runs in a peer's own virtual environment (torch, no JAX): the shape comes from the command line of
the peer script, which step_speed.py fills from `lowcomm_jax.models.ModelConfig`, so both sides
build the same model. The architecture is lowcomm_jax/models/llama.py's: token embedding,
`num_layers` pre-norm blocks (RMSNorm in float32 with a learned scale; causal multi-head attention
with rotary positions on (first half, second half) of each head's features; SwiGLU
down(silu(gate(x)) · up(x))), a final RMSNorm and an untied output head; no biases. Attention is
torch's `scaled_dot_product_attention(is_causal=True)`, what a torch user writes.

`training_flops_per_token` counts the matmul FLOPs of one forward + backward with torch's own
`FlopCounterMode`, so the peer reports what torch executes, to be compared with
`lowcomm_jax.models.flops_per_token` (causal attention counted in full on both sides).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Shape:
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  d_ff: int
  rope_base: float = 10_000.0
  norm_eps: float = 1e-5

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


class RMSNorm(nn.Module):

  def __init__(self, dim: int, eps: float):
    super().__init__()
    self.scale = nn.Parameter(torch.ones(dim))
    self.eps = eps

  def forward(self, x):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale).to(
      x.dtype
    )


def _rotate(x, cos, sin):
  """Rotary positions on x [B, H, T, K]; cos, sin [T, K/2]."""
  x1, x2 = x.float().chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Block(nn.Module):

  def __init__(self, s: Shape):
    super().__init__()
    d, f = s.d_model, s.d_ff
    self.s = s
    self.attn_norm = RMSNorm(d, s.norm_eps)
    self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
    self.mlp_norm = RMSNorm(d, s.norm_eps)
    self.w_gate, self.w_up = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
    self.w_down = nn.Linear(f, d, bias=False)
    for lin in (self.wq, self.wk, self.wv, self.w_gate, self.w_up):
      nn.init.normal_(lin.weight, std=0.02)
    for lin in (self.wo, self.w_down):
      # as llama.py: the residual stream keeps its scale with depth
      nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * s.num_layers))

  def forward(self, x, cos, sin):
    b, t, _ = x.shape
    h, k = self.s.num_heads, self.s.head_dim
    y = self.attn_norm(x)
    heads = lambda lin: lin(y).view(b, t, h, k).transpose(1, 2)
    q, kk = _rotate(heads(self.wq), cos, sin), _rotate(heads(self.wk), cos, sin)
    o = F.scaled_dot_product_attention(q, kk, heads(self.wv), is_causal=True)
    x = x + self.wo(o.transpose(1, 2).reshape(b, t, h * k))
    y = self.mlp_norm(x)
    return x + self.w_down(F.silu(self.w_gate(y)) * self.w_up(y))


class Decoder(nn.Module):

  def __init__(self, s: Shape):
    super().__init__()
    self.s = s
    self.embed = nn.Embedding(s.vocab_size, s.d_model)
    nn.init.normal_(self.embed.weight, std=1.0)
    self.blocks = nn.ModuleList(Block(s) for _ in range(s.num_layers))
    self.final_norm = RMSNorm(s.d_model, s.norm_eps)
    self.head = nn.Linear(s.d_model, s.vocab_size, bias=False)
    nn.init.normal_(self.head.weight, std=0.02)

  def forward(self, tokens_BxT):
    t = tokens_BxT.shape[1]
    k = self.s.head_dim
    inv_freq = 1.0 / (self.s.rope_base ** (torch.arange(0, k, 2, dtype=torch.float32) / k))
    angles = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    x = self.embed(tokens_BxT)
    for block in self.blocks:
      x = block(x, cos, sin)
    return self.head(self.final_norm(x)).float()


def lm_loss(model: Decoder, batch_BxT1):
  """Mean next-token cross-entropy on windows [B, T + 1], as lowcomm_jax.models.loss.lm_loss."""
  logits = model(batch_BxT1[:, :-1])
  return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch_BxT1[:, 1:].reshape(-1))


def add_shape_args(parser) -> None:
  """The model's shape and the sequence length as required command-line flags of a peer script."""
  for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "seq_len"):
    parser.add_argument(f"--{name}", type=int, required=True)


def shape_from_args(a) -> Shape:
  return Shape(a.vocab_size, a.d_model, a.num_layers, a.num_heads, a.d_ff)


def inner_optimizer(model: nn.Module) -> torch.optim.Optimizer:
  """AdamW as our default inner optimizer (lr 3e-3, β = (0.9, 0.95), weight decay 0.1)."""
  return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def inner_steps(model: Decoder, optimizer: torch.optim.Optimizer, batch_BxT1, n: int) -> float:
  """`n` training steps on one batch: loss, backward, global-norm clip to 1.0, optimizer step.

  Returns the last loss. (Wrapped in torchft's DiLoCo, the optimizer's step also runs the outer
  step after every H-th inner step.)
  """
  loss = None
  for _ in range(n):
    optimizer.zero_grad()
    loss = lm_loss(model, batch_BxT1)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
  return float(loss.detach())


def param_count(model: nn.Module) -> int:
  return sum(p.numel() for p in model.parameters())


def training_flops_per_token(shape: Shape, seq_len: int) -> float:
  """Matmul FLOPs of one forward + backward per token, as torch's FlopCounterMode counts them."""
  from torch.nn.attention import SDPBackend, sdpa_kernel  # pylint: disable=g-import-not-at-top
  from torch.utils.flop_counter import FlopCounterMode  # pylint: disable=g-import-not-at-top
  model = Decoder(shape)
  batch = torch.randint(0, shape.vocab_size, (1, seq_len + 1))
  # The math backend: the counter does not see inside the fused CPU attention kernel, whose
  # matmuls are the same (it skips masked blocks; both sides count causal attention in full).
  with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
    lm_loss(model, batch).backward()
  return counter.get_total_flops() / seq_len
