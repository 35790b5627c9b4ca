"""Input checks shared by the SkipPipe schedulers and baselines.

Bad input gets one ValueError naming the option and what is allowed, before
any search runs.
"""

from __future__ import annotations

import numpy as np

from lowcomm_jax.skippipe import paths as paths_lib
from lowcomm_jax.skippipe.topology import Topology


def validate_placement(topology: Topology, placement) -> list[np.ndarray]:
  """Checks that `placement` assigns every node to exactly one stage."""
  placement = [np.asarray(nodes, np.int64) for nodes in placement]
  if len(placement) != topology.num_stages:
    raise ValueError(f"placement: expected {topology.num_stages} stages (one "
                     f"per entry of stage_sizes), got {len(placement)}.")
  for s, nodes in enumerate(placement):
    if len(nodes) != topology.stage_sizes[s]:
      raise ValueError(f"placement: stage {s} must hold stage_sizes[{s}] = "
                       f"{topology.stage_sizes[s]} nodes, got {len(nodes)}.")
  flat = np.concatenate(placement)
  if sorted(flat.tolist()) != list(range(topology.num_nodes)):
    raise ValueError(f"placement: every node 0..{topology.num_nodes - 1} must "
                     f"appear exactly once, got {sorted(flat.tolist())}.")
  return placement


def load_caps(topology: Topology, placement, config: paths_lib.SkipConfig
              ) -> np.ndarray:
  """int[N]: paths a node may be on per iteration (memory x num_waves)."""
  del placement
  return np.asarray(topology.memory, np.int64) * config.num_waves


def check_inputs(topology: Topology, placement, config: paths_lib.SkipConfig
                 ) -> list[np.ndarray]:
  """All input checks of the schedulers; returns the validated placement."""
  config.validate(topology.num_stages, topology.stage_sizes, topology.memory)
  placement = validate_placement(topology, placement)
  caps = load_caps(topology, placement, config)
  streams = len(placement[0]) * config.paths_per_data_node
  # Each stream of `stream_length` micro-batches visits k-1 distinct stages;
  # stage s can take at most min(its stream slots, all streams). Summed over
  # stages this must cover streams x (k-1) (a flow / Hall-type bound that is
  # also sufficient when stages are free to choose).
  slots = [int((caps[nodes] // config.stream_length).sum())
           for nodes in placement[1:]]
  supply = sum(min(slot, streams) for slot in slots)
  demand = streams * (config.path_length - 1)
  if demand > supply:
    raise ValueError(
        f"microbatches_per_data_node: {len(placement[0])} data nodes x "
        f"{config.microbatches_per_data_node} micro-batches need "
        f"{demand * config.stream_length} stage visits (path_length - 1 = "
        f"{config.path_length - 1} each), but stages 1..{topology.num_stages - 1}"
        f" can take at most {supply * config.stream_length} (nodes x memory x "
        f"num_waves, and each micro-batch visits a stage once); lower "
        f"microbatches_per_data_node or path_length.")
  return placement
