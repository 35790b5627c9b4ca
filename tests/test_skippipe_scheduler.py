"""SkipPipe scheduler: constraints hold, baselines compare, bad input fails."""

import dataclasses

import numpy as np
import pytest

from lowcomm_jax.skippipe import (
  baselines,
  constraints,
  inputs,
  paths,
  placement as placement_lib,
  scheduler,
  simulator,
  topology as topology_lib,
)

SMALL_BUDGET = scheduler.SearchBudget(max_cbs_nodes=60, max_solutions=2,
                                      root_orderings=2,
                                      max_path_expansions=5000)


def _random_case(seed, streams=False):
  rng = np.random.default_rng(seed)
  num_stages = int(rng.integers(3, 6))
  sizes = (int(rng.integers(2, 4)),) + tuple(
      int(s) for s in rng.integers(1, 4, size=num_stages - 1))
  topo = topology_lib.random_heterogeneous(seed, sizes)
  path_length = int(rng.integers(2, num_stages + 1))
  placement = placement_lib.optimize_placement(topo, seed=seed, iterations=100)
  # The most micro-batches (at most 6) the stages can take for this k.
  for per_node in range(6, 0, -1):
    config = paths.SkipConfig(path_length=path_length,
                              microbatches_per_data_node=per_node,
                              paths_per_data_node=1 if streams else per_node)
    try:
      inputs.check_inputs(topo, placement, config)
      break
    except ValueError:
      if per_node == 1:
        config = dataclasses.replace(config, path_length=2)
  return topo, placement, config


@pytest.mark.parametrize("streams", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_every_path_satisfies_every_constraint(seed, streams):
  topo, placement, config = _random_case(seed, streams)
  schedule = scheduler.skippipe_schedule(topo, placement, config,
                                         budget=SMALL_BUDGET)
  assert len(schedule.paths) == len(placement[0]) * config.microbatches_per_data_node
  # The planned timeline and the simulated one both obey CC, TC1 and TC2.
  assert constraints.check_schedule(topo, placement, schedule, config) == []
  result = simulator.simulate_iteration(topo, placement, schedule)
  assert constraints.check_schedule(topo, placement, schedule, config,
                                    tasks=result.tasks) == []


def test_checker_flags_broken_paths():
  topo = topology_lib.homogeneous((1, 1, 1, 1))
  placement = [np.array([0]), np.array([1]), np.array([2]), np.array([3])]
  config = paths.SkipConfig(path_length=3, microbatches_per_data_node=2)
  bad = paths.Schedule(paths=(
      paths.MicrobatchPath(0, (0, 3, 1), (0, 3, 1)),   # 3 -> 1 is no swap
      paths.MicrobatchPath(1, (0, 2), (0, 1)),         # wrong node, too short
  ))
  kinds = {v.constraint for v in constraints.check_schedule(
      topo, placement, bad, config)}
  assert kinds == {"cc_order", "cc_start", "cc_length"}
  # Two micro-batches forced onto one node at the same time collide.
  timeline = (paths.Task(0, 1, 1, "F", 0.0, 1.0),
              paths.Task(1, 1, 1, "F", 0.5, 1.5))
  one = paths.Schedule(paths=(paths.MicrobatchPath(0, (0, 1), (0, 1)),
                              paths.MicrobatchPath(1, (0, 1), (0, 1))))
  kinds = {v.constraint for v in constraints.check_schedule(
      topo, placement, one, config, tasks=timeline, check_load=False)}
  assert "tc2_collision" in kinds


def test_stage_and_layer_paths_for_the_model():
  schedule = paths.Schedule(paths=(
      paths.MicrobatchPath(0, (0, 2, 1, 3), (0, 5, 4, 6)),))
  np.testing.assert_array_equal(schedule.stage_paths()[0], [0, 2, 1, 3])
  np.testing.assert_array_equal(schedule.layer_paths(2)[0],
                                [0, 1, 4, 5, 2, 3, 6, 7])


@pytest.mark.parametrize("preset", ["reference", "optimized", "42"])
def test_skippipe_never_slower_than_full_pipeline(preset):
  if preset == "42":
    topo = topology_lib.gcp_42_nodes()
    placement = placement_lib.optimize_placement(topo, seed=0, iterations=300)
    config = paths.SkipConfig(path_length=6)
  else:
    topo = topology_lib.gcp_12_regions()
    placement = (topology_lib.reference_placement_12_regions()
                 if preset == "reference" else
                 placement_lib.optimize_placement(topo, seed=0, iterations=300))
    placement = placement_lib.order_for_pipelines(topo, placement)
    config = paths.SkipConfig()
  sim = simulator.SimulationConfig(include_allreduce=False)
  skip = scheduler.skippipe_schedule(topo, placement, config,
                                     budget=SMALL_BUDGET)
  full = baselines.full_pipeline_schedule(topo, placement, config)
  skip_s = simulator.simulate_iteration(topo, placement, skip, sim)
  full_s = simulator.simulate_iteration(topo, placement, full, sim)
  assert skip_s.pipeline_time_s <= full_s.pipeline_time_s


def test_reference_paths_reproduce_reference_times():
  """Our simulator on the reference's own paths: 33.35 s vs its 33.31 s."""
  topo = topology_lib.gcp_12_regions()
  placement = topology_lib.reference_placement_12_regions()
  stored = topology_lib.reference_data()["reported_results"][
      "schedule_json_collision_aware_paths"]
  mbs = []
  for agent, entry in stored.items():
    for i in range(6):   # 3 micro-batches 1 s apart, 2 waves 2.5 s apart
      mbs.append(paths.MicrobatchPath(
          len(mbs), tuple(entry["stages"]),
          tuple(entry["node_sequence_then_back_to_first"]),
          release_s=(i % 2) * 2.5 + (i // 2) * 1.0))
  result = simulator.simulate_iteration(
      topo, placement, mbs, simulator.SimulationConfig(task_gap_s=0.13))
  assert result.pipeline_time_s == pytest.approx(33.31379, abs=0.1)


def test_placement_cost_matches_reference_score_and_is_seeded():
  topo = topology_lib.gcp_12_regions()
  reference = topology_lib.reference_placement_12_regions()
  assert placement_lib.placement_cost(topo, reference, 1.0) == pytest.approx(
      21.590300540879163, abs=1e-5)
  a = placement_lib.optimize_placement(topo, seed=3, iterations=200)
  b = placement_lib.optimize_placement(topo, seed=3, iterations=200)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert sorted(np.concatenate(a).tolist()) == list(range(20))


def test_bad_input_raises_clear_errors():
  topo = topology_lib.gcp_12_regions()
  placement = topology_lib.reference_placement_12_regions()
  with pytest.raises(ValueError, match=r"path_length: must be between 1 and "
                     r"the number of stages \(6\), got 7"):
    scheduler.skippipe_schedule(topo, placement, paths.SkipConfig(path_length=7))
  with pytest.raises(ValueError, match=r"microbatches_per_data_node: at most "
                     r"memory x num_waves = 3 x 2 = 6 .* got 7"):
    scheduler.skippipe_schedule(
        topo, placement, paths.SkipConfig(microbatches_per_data_node=7))
  with pytest.raises(ValueError, match=r"microbatches_per_data_node: .* need "
                     r"75 stage visits .* but stages 1..5 can take at most "
                     r"45"):
    # 5 data nodes x 3 micro-batches x 5 stages = 75 visits > 15 nodes x 3.
    scheduler.skippipe_schedule(topo, placement, paths.SkipConfig(
        path_length=6, microbatches_per_data_node=3, num_waves=1,
        paths_per_data_node=3))
  with pytest.raises(ValueError, match=r"stage_sizes: every stage needs at "
                     r"least 1 node; stage\(s\) \[1\] are empty"):
    topology_lib.homogeneous((2, 0, 2))
  with pytest.raises(ValueError, match=r"placement: stage 1 must hold"):
    scheduler.skippipe_schedule(topo, [placement[0], placement[1][:2],
                                       *placement[2:]])
