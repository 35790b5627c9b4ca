"""Cross-replica communication and its ledger."""

from lowcomm_jax.comm.collectives import compressed_mean, group_mean, mean, tree_bytes
from lowcomm_jax.comm.ledger import Entry, Ledger, record, ring_factor

__all__ = ["compressed_mean", "group_mean", "Entry", "Ledger", "mean", "record", "ring_factor", "tree_bytes"]
