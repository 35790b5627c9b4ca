"""Optimizers: outer optimizers (and HeLoCo's alignment before them), fragments and schedules,
(Streaming) DiLoCo, SparseLoCo, NoLoCo."""

from lowcomm_jax.optim.alignment import heloco
from lowcomm_jax.optim.fragments import Fragment, layer_fragments, whole_model
from lowcomm_jax.optim.noloco import NoLoCo, NoLoCoState, noloco
from lowcomm_jax.optim.outer import delayed_nesterov, outer_nesterov
from lowcomm_jax.optim.schedule import FragmentSchedule, Phase, make_schedule, phase_at
from lowcomm_jax.optim.sparseloco import SparseLoCo, sparseloco
from lowcomm_jax.optim.streaming import (
  StreamingDiLoCo,
  StreamingDiLoCoState,
  diloco,
  streaming_diloco,
)

__all__ = ["NoLoCo", "NoLoCoState", "noloco", "Fragment", "FragmentSchedule", "Phase",
           "StreamingDiLoCo", "StreamingDiLoCoState", "diloco",
           "layer_fragments", "make_schedule", "delayed_nesterov", "heloco", "outer_nesterov",
           "phase_at",
           "SparseLoCo", "sparseloco", "streaming_diloco",
           "whole_model"]
