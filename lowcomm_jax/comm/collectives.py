"""Cross-replica and cross-stage collectives over named axes (the ONLY place lowcomm_jax calls
them).

The compressed mean (all_to_all + all_gather of codec-encoded chunks) is in `compressed_mean.py`.

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
  """All-reduce mean of every leaf over `axis_name` (a ring: each worker sends 2(M−1)/M ×
  payload)."""
  m = axis_size(axis_name)
  payload = tree_bytes(tree)
  ledger.record(name, "all_reduce", payload, ledger.ring_factor(m) * payload, m)
  return jax.tree.map(lambda x: lax.pmean(x, axis_name), tree)


def permute(tree, axis_name, perm, name: str = "permute", repeats: int = 1):
  """`lax.ppermute` of every leaf along the static pairs `perm` of (source, destination).

  Used by the pipeline executor (`axis_name` a tuple of mesh axes: one index per device). The
  ledger gets the mean bytes one device sends: payload × len(perm) / axis size, times `repeats`,
  the number of times the program runs this call (e.g. the ticks of a scan that share one
  transfer pattern), since a call traced once inside a loop or a switch branch records once.
  """
  perm = [(int(a), int(b)) for a, b in perm]
  m = axis_size(axis_name)
  payload = tree_bytes(tree)
  ledger.record(name, "ppermute", payload, repeats * payload * len(perm) / m, m, repeats)
  return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


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
