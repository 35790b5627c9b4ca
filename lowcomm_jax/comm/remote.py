"""A plan carried by a remote syncer instead of a collective: what goes on the wire, both ends.

In an SPMD run `comm.dispatch.carry` reduces a `comm.Plan`'s tree over the replica axis. An elastic
run (`lowcomm_jax.elastic`) has no replica axis: each learner sends its tree to a syncer process,
which merges the trees that arrived and sends back their mean. This module is the wire format of
that exchange, by plan kind:

  mean              float32 arrays (numpy), what `lax.pmean` would sum
  compressed_mean   the plan's codec, leaf by leaf (`codecs.EncodedTensor`: codes and scales)
  sparse_gather     the plan's top-k compressor, leaf by leaf (`SparseLeaf`: packed positions,
                    packed codes and levels, as `comm.sparse_mean` all-gathers them)

`encode` runs on the learner (with error feedback it also returns the new residual, as the plan's
collective keeps it per replica), `decode` and `mean` on the syncer. Every send is recorded in the
active `comm.Ledger` with `kind="remote"`, its exact payload bytes and the plan's name, as a
collective is; the syncer's reply (the mean, float32) is `reply_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax.comm import ledger
from lowcomm_jax.comm.plan import Plan

REMOTE_KINDS = ("mean", "compressed_mean", "sparse_gather")


@dataclasses.dataclass(frozen=True)
class SparseLeaf:
  """One leaf of a sparse_gather payload: the compressor's three parts and the leaf's shape."""

  indices: np.ndarray
  codes: np.ndarray
  scales: np.ndarray
  shape: tuple

  @property
  def nbytes(self) -> int:
    return self.indices.nbytes + self.codes.nbytes + self.scales.nbytes


def check_plan(plan: Plan, name: str) -> None:
  if plan.kind not in REMOTE_KINDS:
    raise ValueError(f"plan {name!r} of kind {plan.kind} cannot be carried by a syncer "
                     f"(kinds: {', '.join(REMOTE_KINDS)})")


def payload_bytes(tree) -> int:
  """Bytes of a payload or a float32 tree (numpy leaves, `SparseLeaf`s)."""
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, SparseLeaf))
  return sum(x.nbytes if isinstance(x, SparseLeaf) else
             math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in leaves)


@functools.lru_cache(maxsize=None)
def _compiled(codec, method: str, static_argnums: tuple = ()):
  """`codec.<method>` under `jax.jit`, one per codec: a leaf's encoding or decoding is then one
  program compiled once per leaf shape (cached by jit), not each of its ops dispatched and compiled
  on its own, and it computes what the plan's collective computes inside the SPMD step."""
  return jax.jit(getattr(codec, method), static_argnums=static_argnums)


def encode(plan: Plan, name: str, tree: Any, residual: Any = None):
  """(payload, new residual or None): `tree` (float32 leaves) as the syncer receives it.

  The payload holds numpy arrays only (what Ray serializes). With `plan.error_feedback`, `residual`
  (same structure) is decayed by β and added before encoding, and the new residual is what the
  encoding dropped.
  """
  check_plan(plan, name)
  if plan.error_feedback != (residual is not None):
    raise ValueError(f"plan {name!r}: error_feedback={plan.error_feedback} but residual "
                     f"{'missing' if residual is None else 'given'}")
  if plan.kind == "mean":
    payload = jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
    ledger.record(name, "remote", payload_bytes(payload), payload_bytes(payload), 1, plan=name)
    return payload, None
  if residual is not None:
    tree = jax.tree.map(lambda x, e: x + plan.feedback_decay * e, tree, residual)
  if plan.kind == "compressed_mean":
    payload = jax.tree.map(lambda x: jax.tree.map(np.asarray, _compiled(plan.codec, "encode")(
        jnp.asarray(x, jnp.float32))), tree)
  else:
    payload = jax.tree.map(lambda x: SparseLeaf(*jax.tree.map(np.asarray, _compiled(
        plan.codec, "encode")(jnp.asarray(x, jnp.float32))), tuple(np.shape(x))), tree)
  new_residual = None
  if residual is not None:
    new_residual = jax.tree.map(lambda x, d: np.asarray(x, np.float32) - d, tree,
                                decode(plan, payload))
  ledger.record(name, "remote", payload_bytes(payload), payload_bytes(payload), 1, plan=name)
  return payload, new_residual


def _is_encoded(x) -> bool:
  return isinstance(x, SparseLeaf) or hasattr(x, "codes")


def decode(plan: Plan, payload: Any):
  """The float32 tree a payload of `encode` carries (numpy leaves)."""
  if plan.kind == "mean":
    return payload
  if plan.kind == "compressed_mean":
    return jax.tree.map(lambda e: np.asarray(_compiled(plan.codec, "decode")(
        jax.tree.map(jnp.asarray, e))), payload, is_leaf=_is_encoded)
  return jax.tree.map(lambda e: np.asarray(_compiled(plan.codec, "decode", (3,))(
      jnp.asarray(e.indices), jnp.asarray(e.codes), jnp.asarray(e.scales), e.shape)),
                      payload, is_leaf=_is_encoded)


def mean(trees: list, weights: list[float]):
  """The merged tree of the decoded `trees` (float32, in the order given): with equal weights the
  collective's mean (sum in order, then divide by their number), else Σ w_i x_i / Σ w_i."""
  if len(set(weights)) == 1:
    return jax.tree.map(lambda *d: (sum(d[1:], d[0]) / np.float32(len(d))).astype(np.float32),
                        *trees)
  total = sum(weights)
  return jax.tree.map(lambda *d: sum(np.float32(w / total) * x for w, x in zip(weights, d))
                      .astype(np.float32), *trees)


def reply_bytes(tree: Any) -> int:
  """Bytes of the syncer's reply (the mean, float32)."""
  return payload_bytes(tree)
