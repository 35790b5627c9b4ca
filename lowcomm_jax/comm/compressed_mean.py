"""Mean over the replica axis with codec-encoded traffic and float32 accumulation.

Each worker cuts its tensor into M chunks (M = number of replicas), encodes
every chunk with the codec and sends chunk j to worker j (``lax.all_to_all``:
the reduce-scatter step). Worker j decodes the M copies of its chunk, sums
them in fp32 and divides by M, re-encodes that mean and sends it to everyone
(``lax.all_gather``); every worker decodes the M mean chunks and reassembles
the tensor. This is a ring all-reduce's traffic pattern with quantized
messages: each worker sends ``(M-1)`` encoded chunks in each phase, that is
``2(M-1)/M`` times the encoded tensor (:func:`compressed_mean_wire_bytes`).

The codec only encodes and decodes (``Codec.encode_blocks``/``decode_blocks``,
with its Pallas kernels or its jnp reference, see ``kernels``); the chunking
and the two collectives live here, in ``comm``, the one module that issues
cross-replica collectives.

The result is the same on every replica. With the ``fp32`` codec nothing is
rounded and the result is ``lax.pmean`` up to the order of the fp32 sum. With
a lossy codec the error is the mean of the senders' quantization errors plus
the error of quantizing the mean once more.

Call it under a bound axis: ``jax.vmap(..., axis_name=...)`` (simulated
replicas on one device) or ``jax.shard_map`` over a mesh axis. With
``kernels="pallas"`` in interpret mode (CPU) inside ``shard_map``, pass
``check_vma=False``: jax 0.10.2's Pallas interpreter replays the kernel
without the varying-axis annotations and the check rejects it. The jnp
reference has no such restriction.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lowcomm_jax import codecs
from lowcomm_jax.comm import ledger

__all__ = ["compressed_mean", "compressed_mean_wire_bytes", "gather_to_every_worker"]


def _chunk_len(num_elements: int, axis_size: int) -> int:
  return -(-num_elements // axis_size)


def _array_mean(x: jax.Array, axis_name, codec: codecs.Codec, axis_size: int,
                key: jax.Array | None, kernel_options: dict[str, Any]):
  """Compressed mean of one array; returns ``(mean, what this worker's encoding let through)``."""
  num_elements = x.size
  chunk_len = _chunk_len(num_elements, axis_size)
  num_blocks, block_len = codec.layout(chunk_len)
  flat = jnp.pad(x.reshape(-1).astype(jnp.float32), (0, axis_size * chunk_len - num_elements))
  # Blocks never straddle two chunks: each chunk is blocked on its own, as
  # the worker that owns it will re-encode it.
  chunks = jnp.pad(flat.reshape(axis_size, chunk_len),
                   ((0, 0), (0, num_blocks * block_len - chunk_len)))
  send_key = mean_key = None
  if key is not None:
    send_key, mean_key = jax.random.split(jax.random.fold_in(key, lax.axis_index(axis_name)))

  def decode_per_worker(codes, scales):
    """``[M, blocks, C]`` codes to fp32 ``[M, chunk_len]``."""
    blocks = codec.decode_blocks(
        codes.reshape((-1,) + codes.shape[2:]),
        None if scales is None else scales.reshape(-1), **kernel_options)
    return blocks.reshape(axis_size, num_blocks * block_len)[:, :chunk_len]

  def per_worker(array):
    return None if array is None else array.reshape((axis_size, num_blocks) + array.shape[1:])

  codes, scales = codec.encode_blocks(chunks.reshape(axis_size * num_blocks, block_len), send_key,
                                      **kernel_options)
  codes, scales = per_worker(codes), per_worker(scales)
  sent = decode_per_worker(codes, scales).reshape(-1)[:num_elements].reshape(x.shape)

  # Reduce-scatter: row j of what arrives is this worker's chunk from worker j.
  exchange = lambda a: None if a is None else lax.all_to_all(a, axis_name, 0, 0)
  received = decode_per_worker(exchange(codes), exchange(scales))
  chunk_mean = jnp.sum(received, axis=0) / axis_size
  mean_blocks = jnp.pad(chunk_mean, (0, num_blocks * block_len - chunk_len)).reshape(
      num_blocks, block_len)
  mean_codes, mean_scales = codec.encode_blocks(mean_blocks, mean_key, **kernel_options)

  # All-gather: every worker gets every chunk's encoded mean.
  gather = lambda a: None if a is None else gather_to_every_worker(a, axis_name)
  mean = decode_per_worker(gather(mean_codes), gather(mean_scales))
  return mean.reshape(-1)[:num_elements].reshape(x.shape), sent


def gather_to_every_worker(a: jax.Array, axis_name) -> jax.Array:
  """``lax.all_gather`` of ``a`` (result ``[M, ...]``), typed as the same on every worker.

  Under ``shard_map`` (``a`` varying over the axis) the result is marked invariant
  (``to="invarying"``), so what is decoded from it may leave ``shard_map`` replicated (the
  in-flight buffer, φ). vmap has no varying axes (and no invariant all-gather): a plain all-gather.
  """
  varying = axis_name in jax.typeof(a).manual_axis_type.varying
  return lax.all_gather(a, axis_name, to="invarying" if varying else "varying")


def compressed_mean(tree: Any, axis_name, codec: codecs.Codec, name: str = "compressed mean", *,
                    key: jax.Array | None = None, residual: Any = None,
                    kernels: str = "auto"):
  """Mean of every leaf over ``axis_name`` with codec-encoded traffic; recorded in the ledger.

  Args:
    tree: an array or pytree of arrays (any shapes and float dtypes).
    axis_name: the bound replica axis (vmap ``axis_name`` or a mesh axis inside ``shard_map``).
    codec: from :func:`lowcomm_jax.codecs.get_codec`.
    name: what is moved, for the ledger (e.g. ``"fragment 2"``).
    key: PRNG key for stochastic rounding (folded with the replica index so replicas draw
      independent bits); the same key on every replica is fine.
    residual: this replica's previous error-feedback residual (fp32, same structure), or None
      for no feedback (``lowcomm_jax.codecs.error_feedback``: the residual is what this
      replica's encoding of ``tree + residual`` dropped, on exactly the chunks and blocks sent;
      the owner's re-encoding of the mean is shared by all replicas and not fed back).
    kernels: ``"reference"`` (jnp), ``"pallas"`` (the Pallas kernels; interpreted on CPU),
      ``"pallas_mosaic_gpu"`` / ``"pallas_triton"`` (``"pallas"`` with that GPU kernel) or
      ``"auto"`` (Pallas where the platform compiles them: GPU, TPU), see
      :func:`lowcomm_jax.codecs.kernel_options`.

  Returns:
    The fp32 mean (same structure as ``tree``), identical on every replica; with ``residual`` a
    pair ``(mean, new residual)``.
  """
  m = lax.axis_size(axis_name)
  payload = sum(codec.wire_bytes(x.size) for x in jax.tree.leaves(tree))
  ledger.record(name, "all_to_all+all_gather", payload, compressed_mean_wire_bytes(tree, codec, m),
                m)
  kernel_options = codecs.kernel_options(kernels)

  def send(values):
    leaves, treedef = jax.tree.flatten(values)
    keys = [None] * len(leaves) if key is None else list(jax.random.split(key, max(len(leaves), 1)))
    results = [_array_mean(jnp.asarray(leaf), axis_name, codec, m, leaf_key, kernel_options)
               for leaf, leaf_key in zip(leaves, keys)]
    return (jax.tree.unflatten(treedef, [mean for mean, _ in results]),
            jax.tree.unflatten(treedef, [sent for _, sent in results]))

  if residual is None:
    return send(tree)[0]
  return codecs.with_error_feedback(send, tree, residual)


def compressed_mean_wire_bytes(x: Any, codec: codecs.Codec, axis_size: int) -> int:
  """Bytes each worker sends for one :func:`compressed_mean` of ``x``.

  ``2 (M-1)`` encoded chunks of ``ceil(n / M)`` values per array: ``M-1`` in
  the reduce-scatter and ``M-1`` in the all-gather (a ring's share; an
  all-gather implemented otherwise moves the same bytes per worker on
  average). Static, from shapes only.

  Args:
    x: a number of elements, or an array / ShapeDtypeStruct / pytree of them.
    codec: the codec.
    axis_size: number of replicas M.

  Returns:
    The bytes, a Python int.
  """
  if isinstance(x, int):
    sizes = [x]
  else:
    sizes = [math.prod(leaf.shape) for leaf in jax.tree.leaves(x)]
  return sum(2 * (axis_size - 1) * codec.wire_bytes(_chunk_len(size, axis_size))
             for size in sizes)
