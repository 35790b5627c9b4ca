"""Measuring what a codec does to an outer gradient: errors, bits, a stand-in gradient.

Used by ``benchmarks/codecs.py`` and ``colabs/03_quantized_outer_gradients``.
Until a training run provides real outer gradients,
:func:`synthetic_outer_gradient` makes one the way DiLoCo does: train a small
byte-level language model with Adam for a while, then take the parameters
before and after ``inner_steps`` more steps and return their difference
``Δ = θ_before - θ_after`` (docs/algorithms.md §1.1's sign). The text is the source of
the Python standard library's ``json`` package, present on every install.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowcomm_jax.codecs import base
from lowcomm_jax.codecs import registry

__all__ = [
    "synthetic_outer_gradient",
    "relative_rms_error",
    "roundtrip_tree",
    "error_table",
]


def _stdlib_bytes() -> np.ndarray:
  """The bytes of the stdlib ``json`` package's sources: real text on every install."""
  folder = pathlib.Path(json.__file__).parent
  text = b"".join(path.read_bytes() for path in sorted(folder.glob("*.py")))
  return np.frombuffer(text, np.uint8)


def _init_mlp(key: jax.Array, context: int, embed: int, hidden: int) -> dict[str, jax.Array]:
  keys = jax.random.split(key, 3)
  return {
      "embed": jax.random.normal(keys[0], (256, embed)) * 0.02,
      "hidden/w": jax.random.normal(keys[1], (context * embed, hidden)) / np.sqrt(context * embed),
      "hidden/b": jnp.zeros((hidden,)),
      "out/w": jax.random.normal(keys[2], (hidden, 256)) / np.sqrt(hidden),
      "out/b": jnp.zeros((256,)),
  }


def _loss(params, window_BxC, target_B):
  x = params["embed"][window_BxC].reshape(window_BxC.shape[0], -1)
  h = jax.nn.gelu(x @ params["hidden/w"] + params["hidden/b"])
  logits = h @ params["out/w"] + params["out/b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, target_B).mean()


def synthetic_outer_gradient(seed: int = 0, warmup_steps: int = 100, inner_steps: int = 50,
                             batch: int = 64, context: int = 8, embed: int = 32,
                             hidden: int = 512, learning_rate: float = 3e-3
                             ) -> tuple[dict[str, jax.Array], dict[str, float]]:
  """A DiLoCo-style outer gradient of a small byte-level MLP language model.

  Args:
    seed: PRNG seed for the initialization and the batches.
    warmup_steps: Adam steps before the "sync" (so Δ is not the first steps'
      transient).
    inner_steps: H, Adam steps between the two parameter sets.
    batch: sequences per step.
    context: bytes of context the model sees.
    embed: byte embedding width.
    hidden: hidden layer width.
    learning_rate: Adam's learning rate.

  Returns:
    ``(delta, info)``: Δ as a dict of fp32 arrays (about 280k values at the
    defaults) and a dict with the losses before and after the inner steps.
  """
  data = jnp.asarray(_stdlib_bytes(), jnp.int32)
  key_init, key_data = jax.random.split(jax.random.key(seed))
  params = _init_mlp(key_init, context, embed, hidden)
  optimizer = optax.adam(learning_rate)
  opt_state = optimizer.init(params)

  @jax.jit
  def train_step(params, opt_state, step):
    starts = jax.random.randint(jax.random.fold_in(key_data, step), (batch,), 0,
                                data.shape[0] - context - 1)
    window_BxC = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (context,)))(starts)
    loss, grads = jax.value_and_grad(_loss)(params, window_BxC, data[starts + context])
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  loss = jnp.nan
  for step in range(warmup_steps):
    params, opt_state, loss = train_step(params, opt_state, step)
  before, loss_before = params, float(loss)
  for step in range(warmup_steps, warmup_steps + inner_steps):
    params, opt_state, loss = train_step(params, opt_state, step)
  delta = jax.tree.map(jnp.subtract, before, params)
  return delta, {"loss_before": loss_before, "loss_after": float(loss)}


def roundtrip_tree(tree: Any, codec: base.Codec, key: jax.Array | None = None) -> Any:
  """``decode(encode(leaf))`` for every leaf (each leaf blocked on its own)."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = [None] * len(leaves) if key is None else list(jax.random.split(key, len(leaves)))
  return jax.tree.unflatten(treedef, [codec.roundtrip(leaf, k) for leaf, k in zip(leaves, keys)])


def _relative_rms(decoded: Any, tree: Any) -> jax.Array:
  error = sum(jnp.sum((d - x.astype(jnp.float32)) ** 2)
              for d, x in zip(jax.tree.leaves(decoded), jax.tree.leaves(tree)))
  norm = sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree.leaves(tree))
  return jnp.sqrt(error / norm)


def relative_rms_error(tree: Any, codec: base.Codec, key: jax.Array | None = None) -> float:
  """``||decode(encode(Δ)) - Δ|| / ||Δ||`` over the whole tree (2-norms)."""
  return float(jax.jit(lambda t, k: _relative_rms(roundtrip_tree(t, codec, k), t))(tree, key))


def error_table(tree: Any, names: Sequence[str] = tuple(registry.CODECS),
                block_sizes: Sequence[int] = (128, 1024),
                key: jax.Array | None = None) -> list[dict[str, Any]]:
  """Relative RMS error and wire bits per value of each codec on ``tree``.

  Args:
    tree: the outer gradient (pytree of arrays).
    names: codec names.
    block_sizes: block sizes to compare; ``"per_tensor"`` is always added
      (one block per leaf).
    key: PRNG key; when given, a stochastic-rounding column is added at the
      first block size.

  Returns:
    One dict per codec: ``codec``, ``bits_per_value[<block>]`` and
    ``relative_rms[<block>]`` per block size (and ``stochastic``).
  """
  sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(tree)]
  total = sum(sizes)
  largest = max(sizes)
  variants = {}  # (codec name, column) -> codec
  for name in names:
    for block in list(block_sizes) + ["per_tensor"]:
      size = largest if block == "per_tensor" else block
      variants[name, str(block)] = registry.get_codec(name, block_size=size)
    if key is not None:
      variants[name, f"{block_sizes[0]}_stochastic"] = registry.get_codec(
          name, block_size=block_sizes[0], rounding="stochastic")

  # One program for the whole table: compiling each variant apart costs more
  # than running them.
  @jax.jit
  def all_errors(tree, key):
    keys = jax.random.split(key, len(variants)) if key is not None else [None] * len(variants)
    return {f"{name}|{column}": _relative_rms(roundtrip_tree(tree, codec, k), tree)
            for ((name, column), codec), k in zip(variants.items(), keys)}

  errors = jax.device_get(all_errors(tree, key))
  rows = []
  for name in names:
    row: dict[str, Any] = {"codec": name, "bits_per_value": {}, "relative_rms": {}}
    for (codec_name, column), codec in variants.items():
      if codec_name != name:
        continue
      row["relative_rms"][column] = float(errors[f"{name}|{column}"])
      if not column.endswith("_stochastic"):
        row["bits_per_value"][column] = 8 * sum(codec.wire_bytes(n) for n in sizes) / total
    rows.append(row)
  return rows
