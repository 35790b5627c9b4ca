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
