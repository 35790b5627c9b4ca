"""How long one synchronization of N workers takes: NoLoCo against all-reduce.

NoLoCo (arXiv 2506.10911, docs/algorithms.md §2.3, §2.6) never all-reduces: at each
outer step every worker swaps two tensors, its slow weights φ and its outer
gradient Δ, with one random peer. DiLoCo all-reduces one tensor, the outer
gradient, over all N workers. With ``S`` bytes per tensor, bandwidth ``B``
and latency ``ℓ`` (``network.py``) and ``b = 8S/B``:

* NoLoCo pairwise exchange (2 tensors, one message to one peer)::

    T_pair = ℓ + 2b                       (independent of N)

* DiLoCo ring all-reduce::

    T_ring = 2(N−1)/N · b + 2(N−1)·ℓ

* DiLoCo tree all-reduce (reduce up a binary tree, broadcast down)::

    T_tree = 2·⌈log2 N⌉ · (ℓ + b)

Speed-up over the tree: ``T_tree / T_pair = 2⌈log2 N⌉(ℓ + b) / (ℓ + 2b)``,
which tends to ⌈log2 N⌉ once the payload dominates the latency (b ≫ ℓ):
about 10× at N = 1024, the paper's claim. Against the ring the gain comes
only from latency: the ring moves about as many bytes per worker (2b) but
pays 2(N−1) latencies.

Model sizes are the NoLoCo configs' shapes (docs/algorithms.md §2.5), counted as a
Llama decoder: per layer 4d² attention weights (full multi-head, no grouped
keys and values in the configs), a SwiGLU MLP of 3·d·f and two RMSNorm
scales of d; a final norm d; untied input embedding and output head of V·d
each with the Llama-3 vocabulary V = 128,002. The large vocabulary makes the
"125M" model 310M parameters; the names follow the GPT-3 sizes of the same
widths and depths. Tensors are sent in fp32 (4 bytes per parameter), as the
slow weights and outer gradients are kept in fp32; pass
``bytes_per_param=2`` for bf16, which halves every ``b``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from lowcomm_jax.sim import network as network_lib

__all__ = [
    "llama_param_count", "NOLOCO_MODELS", "SyncTimes", "sync_times",
    "speedup_over_tree", "latency_table", "WORKER_COUNTS",
]

LLAMA3_VOCAB = 128_002


def llama_param_count(d_model: int, num_layers: int, ffn_dim: int,
                      vocab_size: int = LLAMA3_VOCAB,
                      tie_embeddings: bool = False) -> int:
  """Parameters of a Llama-style decoder (MHA, SwiGLU, RMSNorm, no biases).

  ``L·(4d² + 3·d·f + 2d) + d + V·d·(1 if tied else 2)``.
  """
  per_layer = 4 * d_model**2 + 3 * d_model * ffn_dim + 2 * d_model
  embeddings = vocab_size * d_model * (1 if tie_embeddings else 2)
  return num_layers * per_layer + d_model + embeddings


# docs/algorithms.md §2.5: (d_model, layers, FFN) of the NoLoCo configs.
NOLOCO_MODELS = {
    "125M": llama_param_count(768, 12, 3072),
    "1.3B": llama_param_count(2048, 24, 8192),
    "6.8B": llama_param_count(4096, 32, 16384),
}

# N from 8 to 4096 workers, powers of two.
WORKER_COUNTS = tuple(2**k for k in range(3, 13))


class SyncTimes(NamedTuple):
  """Seconds of one synchronization under each scheme."""

  pairwise: float
  ring: float
  tree: float


def sync_times(num_params: float, num_workers: int,
               network: "network_lib.Network | str",
               bytes_per_param: float = 4.0) -> SyncTimes:
  """T_pair, T_ring and T_tree for one outer step (formulas in the module doc).

  Args:
    num_params: parameters per tensor (the whole model).
    num_workers: N, data-parallel workers.
    network: each worker's link.
    bytes_per_param: 4 for fp32, 2 for bf16.
  """
  net = network_lib.parse_network(network)
  tensor_bytes = num_params * bytes_per_param
  # The two tensors go to the same peer: one message of 2S bytes.
  pairwise = network_lib.pairwise_exchange_seconds(2 * tensor_bytes, 2, net)
  ring = network_lib.ring_all_reduce_seconds(tensor_bytes, num_workers, net)
  tree = network_lib.tree_all_reduce_seconds(tensor_bytes, num_workers, net)
  return SyncTimes(pairwise, ring, tree)


def speedup_over_tree(num_params: float, num_workers: int,
                      network: "network_lib.Network | str",
                      bytes_per_param: float = 4.0) -> float:
  """T_tree / T_pair; → ⌈log2 N⌉ when bandwidth dominates."""
  times = sync_times(num_params, num_workers, network, bytes_per_param)
  return times.tree / times.pairwise


def latency_table(models: "dict[str, float] | None" = None,
                  worker_counts: Sequence[int] = WORKER_COUNTS,
                  networks: "Sequence[network_lib.Network | str]" = (
                      "100Mbit,50ms", "1Gbit,50ms"),
                  bytes_per_param: float = 4.0) -> list[dict]:
  """One row per (model, network, N) with the three times and the speed-ups.

  Args:
    models: name → parameter count; the NoLoCo models by default.
    worker_counts: values of N.
    networks: links to compare; by default 100 Mbit/s and 1 Gbit/s with the
      ``internet`` preset's 50 ms latency.
    bytes_per_param: 4 for fp32, 2 for bf16.

  Returns:
    Rows with keys model, params, bandwidth_bits_per_s, latency_s, workers,
    pairwise_s, ring_s, tree_s, speedup_vs_tree, speedup_vs_ring, log2_workers.
  """
  models = NOLOCO_MODELS if models is None else models
  rows = []
  for name, params in models.items():
    for spec in networks:
      net = network_lib.parse_network(spec)
      for n in worker_counts:
        times = sync_times(params, n, net, bytes_per_param)
        rows.append(dict(
            model=name, params=int(params),
            bandwidth_bits_per_s=net.bandwidth_bits_per_s,
            latency_s=net.latency_s, workers=n,
            pairwise_s=times.pairwise, ring_s=times.ring, tree_s=times.tree,
            speedup_vs_tree=times.tree / times.pairwise,
            speedup_vs_ring=times.ring / times.pairwise,
            log2_workers=math.log2(n)))
  return rows
