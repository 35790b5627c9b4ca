"""Mean over the replica axis of top-k sparsified, 2-bit payloads: SparseLoCo's exchange.

Each worker encodes its tensors with a :class:`~lowcomm_jax.codecs.TopKCompressor`
(the k largest entries of every chunk: packed positions, packed 1- or 2-bit
codes, per-chunk levels), and the three parts of the whole tree are
all-gathered (``lax.all_gather``: three collectives per call, whatever the
number of leaves). Every worker then decodes the M payloads and adds them,
worker 0 first, into a dense float32 buffer (a scatter-add: positions are
distinct within one payload, so each element receives at most one value per
worker, in a fixed order) and divides by M. No dense tensor crosses the wire.

Error feedback with decay β (SparseLoCo's replacement for the outer momentum):
with ``residual`` given, the worker sends ``e ← β·e + Δ`` and keeps
``e − decode(own payload)`` for the next round.

Bytes, in the ledger (kind ``"all_gather"``): the payload is the encoded tree
(``TopKCompressor.wire_bytes`` summed over the leaves), and a worker sends
``(M−1)·payload``: its own payload to each other worker, which is what a ring
all-gather moves per worker (M−1 steps of one payload each) and what any
all-gather moves per worker on average. Unlike an all-reduce, the traffic
grows with M: the payloads are sparse in different places and cannot be
summed on the way.

Call it under a bound axis: ``jax.vmap(..., axis_name=...)`` (simulated
replicas) or ``jax.shard_map`` over a mesh axis; under ``shard_map`` the mean
is typed as the same on every worker, so it may leave replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lowcomm_jax import codecs
from lowcomm_jax.codecs.topk import TopKCompressor
from lowcomm_jax.comm import ledger
from lowcomm_jax.comm.compressed_mean import gather_to_every_worker

__all__ = ["sparse_mean", "sparse_mean_wire_bytes"]


def _mean_of_payloads(compressor: TopKCompressor, encoded, gathered, leaves, axis_size: int):
  """The float32 mean of every leaf from the M gathered payloads of the whole tree.

  ``gathered`` holds the three parts, each ``[M, every leaf's part laid end to end]``; ``encoded``
  is this worker's payload, whose shapes say where each leaf's part lies. All leaves are added
  into one dense buffer, so the program has M scatter-adds, whatever the number of leaves.
  """
  positions, values, spans = [], [], []
  offsets, dense_size = [0, 0, 0], 0
  for parts, leaf in zip(encoded, leaves):
    pieces = []
    for i, part in enumerate(parts):
      pieces.append(gathered[i][:, offsets[i]:offsets[i] + part.size].reshape(
          (axis_size,) + part.shape))
      offsets[i] += part.size
    position, value = jax.vmap(
        lambda i, q, s, n=leaf.size: compressor.decode_sparse(i, q, s, n))(*pieces)
    positions.append(position.reshape(axis_size, -1) + dense_size)
    values.append(value.reshape(axis_size, -1))
    spans.append((dense_size, leaf.size, leaf.shape))
    layout = compressor.layout(leaf.size)
    dense_size += layout.num_chunks * layout.chunk_len
  positions, values = jnp.concatenate(positions, axis=1), jnp.concatenate(values, axis=1)
  total = jnp.zeros(dense_size, jnp.float32)
  for w in range(axis_size):  # static slices: a traced worker index would not partition
    total = total.at[positions[w]].add(values[w], unique_indices=True)
  return [(total[start:start + n] / axis_size).reshape(shape) for start, n, shape in spans]


def sparse_mean(tree: Any, axis_name, compressor: TopKCompressor, name: str = "sparse mean", *,
                residual: Any = None, decay: float = 1.0):
  """Mean over ``axis_name`` of every worker's top-k payload; recorded in the ledger.

  Args:
    tree: an array or pytree of arrays (any shapes and float dtypes): this worker's Δ.
    axis_name: the bound replica axis (vmap ``axis_name`` or a mesh axis inside ``shard_map``).
    compressor: the chunking, k and bits (:class:`~lowcomm_jax.codecs.TopKCompressor`).
    name: what is moved, for the ledger (e.g. ``"fragment 2"``).
    residual: this worker's error-feedback buffer ``e`` (float32, same structure), or None for
      no feedback (``tree`` itself is compressed).
    decay: β, the factor on ``e`` before the new Δ is added (1.0: plain error feedback).

  Returns:
    The float32 mean ``(1/M) Σ_r decode(payload_r)`` (same structure as ``tree``), identical on
    every worker; with ``residual`` a pair ``(mean, new residual)`` where the new residual is
    ``β·e + Δ − decode(own payload)``.
  """
  m = lax.axis_size(axis_name)
  payload = sparse_mean_wire_bytes(tree, compressor)
  ledger.record(name, "all_gather", payload, (m - 1) * payload, m)

  def send(values):
    leaves, treedef = jax.tree.flatten(values)
    encoded = [compressor.encode(jnp.asarray(leaf)) for leaf in leaves]
    sent = [compressor.decode(*parts, leaf.shape) for parts, leaf in zip(encoded, leaves)]
    # One all-gather per part for the whole tree: the leaves' parts laid end to end.
    gathered = [gather_to_every_worker(jnp.concatenate([parts[i].reshape(-1) for parts in encoded]),
                                       axis_name) for i in range(3)]
    means = _mean_of_payloads(compressor, encoded, gathered, leaves, m)
    return jax.tree.unflatten(treedef, means), jax.tree.unflatten(treedef, sent)

  if not jax.tree.leaves(tree):
    return tree if residual is None else (tree, residual)
  if residual is None:
    return send(tree)[0]
  return codecs.with_error_feedback(send, tree, jax.tree.map(lambda e: decay * e, residual))


def sparse_mean_wire_bytes(tree: Any, compressor: TopKCompressor) -> int:
  """Payload bytes of one worker in :func:`sparse_mean` of ``tree`` (a number of elements, or an
  array / ShapeDtypeStruct / pytree of them); a worker sends ``(M−1)`` times this."""
  sizes = [tree] if isinstance(tree, int) else [leaf.size for leaf in jax.tree.leaves(tree)]
  return sum(compressor.wire_bytes(size) for size in sizes)
