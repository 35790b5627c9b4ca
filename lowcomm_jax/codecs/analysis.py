"""Measuring what a codec does to an outer gradient: errors and wire bits.

Used by ``benchmarks/codecs.py`` and ``colabs/03_quantized_outer_gradients``, on a real outer
gradient from the Trainer (``lowcomm_jax.train.outer_gradient.diloco_outer_gradient``).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax.codecs import base, registry

__all__ = [
    "relative_rms_error",
    "roundtrip_tree",
    "error_table",
]


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
