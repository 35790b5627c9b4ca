"""SkipPipe iteration simulator against hand-computed timelines."""

import dataclasses

import numpy as np
import pytest

from lowcomm_jax.skippipe import gantt, paths, simulator, topology as topology_lib


def _two_nodes(memory=3):
  # Node 0 = stage 0 (data), node 1 = stage 1; forward 1 s, every hop 0.5 s,
  # so backward 1.5 s and loss 0.25 s.
  return topology_lib.homogeneous((1, 1), forward_s=1.0, link_cost_s=0.5,
                                  memory=memory)


def _timeline(result):
  return [(t.microbatch, t.node, t.kind, round(t.start, 9), round(t.end, 9))
          for t in result.tasks]


def test_two_nodes_one_microbatch():
  topo, placement = _two_nodes(), [np.array([0]), np.array([1])]
  mb = paths.MicrobatchPath(0, (0, 1), (0, 1))
  result = simulator.simulate_iteration(topo, placement, [mb])
  # F0 [0,1] -> hop -> F1 [1.5,2.5] -> hop -> loss on 0 [3,3.25] -> hop ->
  # B1 [3.75,5.25] -> hop -> B0 [5.75,7.25].
  assert _timeline(result) == ([
      (0, 0, "F", 0.0, 1.0), (0, 1, "F", 1.5, 2.5), (0, 0, "L", 3.0, 3.25),
      (0, 1, "B", 3.75, 5.25), (0, 0, "B", 5.75, 7.25)])
  assert result.pipeline_time_s == pytest.approx(7.25)
  np.testing.assert_allclose(result.node_busy_s, [2.75, 2.5])
  np.testing.assert_allclose(result.node_idle_s, [4.5, 4.75])


def test_two_nodes_two_microbatches_wait_on_collisions():
  topo, placement = _two_nodes(), [np.array([0]), np.array([1])]
  mbs = [paths.MicrobatchPath(m, (0, 1), (0, 1)) for m in range(2)]
  result = simulator.simulate_iteration(topo, placement, mbs)
  # mb 1 queues behind mb 0 on node 0; its backward on node 1 arrives at 4.75
  # while mb 0's backward runs until 5.25, so it waits.
  assert _timeline(result) == ([
      (0, 0, "F", 0.0, 1.0), (1, 0, "F", 1.0, 2.0), (0, 1, "F", 1.5, 2.5),
      (1, 1, "F", 2.5, 3.5), (0, 0, "L", 3.0, 3.25), (0, 1, "B", 3.75, 5.25),
      (1, 0, "L", 4.0, 4.25), (1, 1, "B", 5.25, 6.75),
      (0, 0, "B", 5.75, 7.25), (1, 0, "B", 7.25, 8.75)])
  assert result.pipeline_time_s == pytest.approx(8.75)


def test_two_nodes_memory_one_serialises_microbatches():
  topo, placement = _two_nodes(memory=1), [np.array([0]), np.array([1])]
  mbs = [paths.MicrobatchPath(m, (0, 1), (0, 1)) for m in range(2)]
  result = simulator.simulate_iteration(topo, placement, mbs)
  # mb 1 is admitted only when mb 0 has freed both nodes (at 7.25).
  assert result.microbatch_done_s == pytest.approx([7.25, 14.5])


def test_three_nodes_with_allreduce():
  # Node 0: stage 0. Nodes 1 and 2: stage 1 (node 2 twice as slow).
  link = np.array([[0.0, 0.5, 1.0], [0.5, 0.0, 0.25], [1.0, 0.25, 0.0]])
  base = topology_lib.homogeneous((1, 2), forward_s=1.0)
  # Activations weigh 0 bytes, so a hop costs its latency: 0.5 s (0-1),
  # 1.0 s (0-2), 0.25 s (1-2). Gradients: 2 GiB per stage over 1 GiB/s.
  topo = dataclasses.replace(
      base, forward_s=np.array([1.0, 1.0, 2.0]), latency_ms=link * 1000,
      bandwidth_gibps=np.full((3, 3), 1.0), hop_overhead_s=0.0,
      activation_bytes=0.0, dp_bytes=2 * 1024.0**3)
  placement = [np.array([0]), np.array([1, 2])]
  mbs = [paths.MicrobatchPath(0, (0, 1), (0, 1)),
         paths.MicrobatchPath(1, (0, 1), (0, 2))]
  result = simulator.simulate_iteration(topo, placement, mbs)
  # mb0: F0 [0,1] F1 [1.5,2.5] L0 [3,3.25] B1 [3.75,5.25] B0 [5.75,7.25]
  # mb1: F0 [1,2] F2 [3,5] L0 waits for B0(mb0): [7.25,7.5]
  #      B2 [8.5,11.5] B0 [12.5,14].
  assert _timeline(result) == ([
      (0, 0, "F", 0.0, 1.0), (1, 0, "F", 1.0, 2.0), (0, 1, "F", 1.5, 2.5),
      (0, 0, "L", 3.0, 3.25), (1, 2, "F", 3.0, 5.0), (0, 1, "B", 3.75, 5.25),
      (0, 0, "B", 5.75, 7.25), (1, 0, "L", 7.25, 7.5),
      (1, 2, "B", 8.5, 11.5), (1, 0, "B", 12.5, 14.0)])
  # Ring of 2 over the 1-2 link: 2 steps of 0.25 s + 1 GiB / (1 GiB/s),
  # starting when node 2's last backward ends at 11.5.
  assert result.allreduce_s == pytest.approx([0.0, 2 * (0.25 + 1.0)])
  assert result.stage_done_s == pytest.approx([14.0, 11.5 + 2.5])
  assert result.pipeline_time_s == pytest.approx(14.0)
  assert result.iteration_time_s == pytest.approx(14.0)
  np.testing.assert_allclose(result.node_busy_s, [5.5, 2.5, 5.0])


def test_gantt_writes_png(tmp_path):
  topo, placement = _two_nodes(), [np.array([0]), np.array([1])]
  mbs = [paths.MicrobatchPath(m, (0, 1), (0, 1)) for m in range(2)]
  result = simulator.simulate_iteration(topo, placement, mbs)
  path = gantt.save_gantt(tmp_path / "g.png", topo, placement, result)
  assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
