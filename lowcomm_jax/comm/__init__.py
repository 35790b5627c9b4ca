"""Cross-replica communication and its ledger: the only package that issues collectives (and, for
elastic runs, the wire format of a plan carried by a remote syncer: `comm.remote`)."""

from lowcomm_jax.comm import remote
from lowcomm_jax.comm.collectives import group_mean, mean, permute, tree_bytes
from lowcomm_jax.comm.compressed_mean import compressed_mean, compressed_mean_wire_bytes
from lowcomm_jax.comm.dispatch import carry
from lowcomm_jax.comm.executor import Issued, OuterCommExecutor, check_layout, fragment_mean
from lowcomm_jax.comm.ledger import Entry, Ledger, record, ring_factor
from lowcomm_jax.comm.plan import COMM_STATE_AXES, CommState, OuterStep, Plan
from lowcomm_jax.comm.sparse_mean import sparse_mean, sparse_mean_wire_bytes

__all__ = ["COMM_STATE_AXES", "CommState", "OuterStep", "Plan", "carry", "compressed_mean",
           "compressed_mean_wire_bytes", "group_mean", "Entry", "Issued", "Ledger",
           "OuterCommExecutor", "check_layout", "fragment_mean", "mean", "permute", "record",
           "remote", "ring_factor", "sparse_mean", "sparse_mean_wire_bytes", "tree_bytes"]
