"""SparseLoCo (arXiv 2508.15706): Streaming DiLoCo's schedule with top-k, 2-bit outer gradients.

Per fragment p, every H inner steps (docs/sparseloco.md):

  e_{m,p} ← β·e_{m,p} + Δ_{m,p}              error feedback with decay β, per replica
  Δ̂_{m,p} = Q(TopK(e_{m,p})); e_{m,p} ← e_{m,p} − Δ̂_{m,p}
  φ_p ← φ_p − η·(1/M)·Σ_m Δ̂_{m,p}            all-gather of the sparse payloads, scatter-add mean
  θ_{m,p} ← α·θ_{m,p} + (1 − α)·φ_p

The error buffer replaces the outer momentum: the outer optimizer is plain SGD with learning rate η.
It is `StreamingDiLoCo` with one change, its plans: kind `sparse_gather` with the compressor and
error feedback of decay β (`comm.Plan`); fragments, τ, α, the executor thread and the state's
layout are Streaming DiLoCo's.
"""

from __future__ import annotations

import optax

from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax.codecs.topk import TopKCompressor
from lowcomm_jax.optim import streaming


class SparseLoCo(streaming.StreamingDiLoCo):
  """`StreamingDiLoCo` whose fragments travel as SparseLoCo's sparse gather (see the module doc)."""

  plan_kind = "sparse_gather"

  def __init__(self, inner, outer, schedule, fragments, compressor: TopKCompressor,
               feedback_decay: float, axis_name: str = mesh_lib.REPLICA):
    self.feedback_decay = float(feedback_decay)  # read by the plans the schedule builds
    super().__init__(inner, outer, schedule, fragments, axis_name, codec=compressor,
                     error_feedback=True, codec_kernels="reference")


def sparseloco(inner: optax.GradientTransformation, sync_every: int = 50,
               fragments: streaming.FragmentsArg = 1, overlap_steps: int = 0,
               merge_alpha: float = 0.0, chunk_size: int = 4096, top_k: int = 64, bits: int = 2,
               feedback_decay: float = 0.95, outer_learning_rate: float = 1.0,
               staggered: bool = True, fragment_pattern: str = "strided",
               non_block_fragment: str = "own", overlap_anchor: str = "send",
               axis_name: str = mesh_lib.REPLICA) -> SparseLoCo:
  """SparseLoCo (arXiv 2508.15706), optax-style like `streaming_diloco`.

  Args:
    inner: the inner optimizer (e.g. `optax.adamw`).
    sync_every: H, inner steps between two syncs of the same fragment.
    fragments: as `streaming_diloco`'s (1: the whole model, as the paper).
    overlap_steps: τ, inner steps the gather of a fragment overlaps before it is applied.
    merge_alpha: α, weight of the local parameters when the global fragment is merged in.
    chunk_size: values per top-k chunk (the paper: 4096).
    top_k: values kept per chunk, at most `chunk_size` (the paper: 64, 1.56 %).
    bits: 1 or 2 bits per kept value (the paper: 2).
    feedback_decay: β in e ← β·e + Δ, in [0, 1].
    outer_learning_rate: η of the outer SGD step (no momentum: the error buffer is the momentum).
    staggered, fragment_pattern, non_block_fragment, overlap_anchor, axis_name: as
      `streaming_diloco`'s.

  Example (simulated replicas, as `diloco`'s)::

    tx = lowcomm_jax.sparseloco(optax.adamw(1e-3), sync_every=50, top_k=64, chunk_size=4096)
    params_R, state = tx.init_replicated(params, num_replicas=4)
  """
  if not 0.0 <= feedback_decay <= 1.0:
    raise ValueError(f"sparseloco.feedback_decay (β) must be in [0, 1], got {feedback_decay}")
  if not outer_learning_rate > 0:
    raise ValueError(f"sparseloco.outer_learning_rate must be > 0, got {outer_learning_rate}")
  compressor = TopKCompressor(chunk_size, top_k, bits)
  schedule, resolve = streaming.schedule_and_fragments(
      sync_every, fragments, overlap_steps, merge_alpha, staggered, fragment_pattern,
      non_block_fragment, overlap_anchor)
  return SparseLoCo(inner, optax.sgd(outer_learning_rate), schedule, resolve, compressor,
                    feedback_decay, axis_name)
