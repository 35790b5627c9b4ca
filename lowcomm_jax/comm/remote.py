"""A plan carried by a remote syncer instead of a collective: what goes on the wire, both ends.

In an SPMD run `comm.dispatch.carry` reduces a `comm.Plan`'s tree over the replica axis. An elastic
run (`lowcomm_jax.elastic`) has no replica axis: each learner sends its tree to a syncer process,
which merges the trees that arrived and sends back the result. This module is the wire format of
that exchange, by plan kind:

  mean              float32 arrays (numpy), what `lax.pmean` would sum
  compressed_mean   the plan's codec, leaf by leaf (`codecs.EncodedTensor`: codes and scales)

`encode` runs on the learner (with error feedback it also returns the new residual, as
`compressed_mean` keeps it per replica), `decode` on the syncer. Every send is recorded in the
active `comm.Ledger` with `kind="remote"`, its exact payload bytes and the plan's name, as a
collective is; the syncer's reply (the new φ_p, float32) is `reply_bytes`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowcomm_jax.comm import ledger
from lowcomm_jax.comm.plan import Plan

REMOTE_KINDS = ("mean", "compressed_mean")


def check_plan(plan: Plan, name: str) -> None:
  if plan.kind not in REMOTE_KINDS:
    raise ValueError(f"plan {name!r} of kind {plan.kind} cannot be carried by a syncer "
                     f"(kinds: {', '.join(REMOTE_KINDS)})")


def _nbytes(tree) -> int:
  return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


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
    new_residual = None
  else:
    if residual is not None:
      tree = jax.tree.map(lambda x, e: x + plan.feedback_decay * e, tree, residual)
    encoded = jax.tree.map(lambda x: plan.codec.encode(jnp.asarray(x, jnp.float32)), tree)
    payload = jax.tree.map(np.asarray, encoded)
    new_residual = None
    if residual is not None:
      new_residual = jax.tree.map(
          lambda x, e: np.asarray(x, np.float32) - np.asarray(plan.codec.decode(e)), tree, encoded)
  ledger.record(name, "remote", _nbytes(payload), _nbytes(payload), 1, plan=name)
  return payload, new_residual


def decode(plan: Plan, payload: Any):
  """The float32 tree a payload of `encode` carries (numpy leaves)."""
  if plan.kind == "mean":
    return payload
  is_encoded = lambda x: hasattr(x, "codes")
  return jax.tree.map(lambda e: np.asarray(plan.codec.decode(jax.tree.map(jnp.asarray, e))),
                      payload, is_leaf=is_encoded)


def reply_bytes(tree: Any) -> int:
  """Bytes of the syncer's reply (the new global fragment φ_p, float32)."""
  return _nbytes(tree)
