"""Cross-replica collectives over a named axis (the ONLY place lowcomm_jax calls them).

Call these under a bound replica axis: inside `jax.vmap(..., axis_name="replica")`
(simulated replicas), or `jax.shard_map` / jit over a mesh axis. Each call
records its traffic in the active ledger.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lowcomm_jax.comm import ledger


def tree_bytes(tree) -> int:
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def axis_size(axis_name: str) -> int:
  return lax.axis_size(axis_name)


def mean(tree, axis_name: str, name: str = "mean"):
  """All-reduce mean of every leaf over `axis_name` (a ring: each worker sends 2(M−1)/M × payload)."""
  m = axis_size(axis_name)
  payload = tree_bytes(tree)
  ledger.record(name, "all_reduce", payload, ledger.ring_factor(m) * payload, m)
  return jax.tree.map(lambda x: lax.pmean(x, axis_name), tree)


def compressed_mean(tree, axis_name: str, codec, name: str = "compressed mean", key=None,
                    residual=None):
  """Mean over `axis_name` with codec-encoded traffic and float32 accumulation.

  Reduce-scatter of encoded chunks (all_to_all), decode, float32 sum, re-encode, all_gather
  (`lowcomm_jax.codecs.compressed_mean`). Each worker sends 2(M−1)/M × the encoded tree,
  codes and scales counted exactly.

  Args:
    residual: the previous error-feedback residual (same structure), or None for no feedback.

  Returns:
    The mean, or (mean, new residual) when `residual` is given.
  """
  from lowcomm_jax import codecs  # pylint: disable=g-import-not-at-top
  m = axis_size(axis_name)
  payload = sum(codec.wire_bytes(x.size) for x in jax.tree.leaves(tree))
  ledger.record(name, "all_to_all+all_gather", payload,
                codecs.compressed_mean_wire_bytes(tree, codec, m), m)
  if residual is None:
    return codecs.compressed_mean(tree, axis_name, codec, m, key=key)
  corrected = jax.tree.map(lambda g, r: g + r, tree, residual)
  return codecs.compressed_mean(corrected, axis_name, codec, m, key=key, return_residual=True)


def group_mean(tree, axis_name: str, groups, name: str = "group mean", codec=None):
  """Mean of every leaf within static groups of replicas, by point-to-point exchange only.

  `groups` is an int array [num_groups, n] partitioning the replicas. For r = 1..n−1 every member
  sends its values to the member r places further round its group (`lax.ppermute` with a static
  permutation), so each worker sends (n−1) × the payload and no collective spans the whole axis.

  With a `codec` (`lowcomm_jax.codecs`), each member sends its leaves encoded and averages the
  decoded values, its own included, so every member of a group gets the same mean; the payload is
  the codec's wire bytes (codes and scales).
  """
  groups = [list(map(int, g)) for g in groups]
  n = len(groups[0])
  if codec is None:
    payload, sent = tree_bytes(tree), tree
    decode = lambda t: t
  else:
    from lowcomm_jax.codecs import EncodedTensor  # pylint: disable=g-import-not-at-top
    payload = sum(codec.wire_bytes(x.size) for x in jax.tree.leaves(tree))
    sent = jax.tree.map(codec.encode, tree)
    decode = lambda t: jax.tree.map(codec.decode, t, is_leaf=lambda x: isinstance(x, EncodedTensor))
  ledger.record(name, "ppermute", payload, (n - 1) * payload, n)
  total = decode(sent)
  for shift in range(1, n):
    perm = [(g[a], g[(a + shift) % n]) for g in groups for a in range(n)]
    received = jax.tree.map(lambda x, p=perm: lax.ppermute(x, axis_name, p), sent)
    total = jax.tree.map(jnp.add, total, decode(received))
  return jax.tree.map(lambda x: x / n, total)
