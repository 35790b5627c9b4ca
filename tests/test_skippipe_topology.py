"""SkipPipe topologies: reference figures, presets and the random generator."""

import numpy as np
import pytest

from lowcomm_jax.skippipe import topology as topology_lib


def test_link_costs_match_the_reference_schedule():
  topo = topology_lib.gcp_12_regions()
  data = topology_lib.reference_data()["link_cost_s_schedule_json_setup"]
  region = {r: i for i, r in enumerate(data["regions"])}
  stored = np.array(data["matrix"])
  names = [n.rsplit("-", 1)[0] for n in topo.node_names]
  for a in range(20):
    for b in range(20):
      if a == b:
        continue
      want = (data["same_region_distinct_nodes_s"] if names[a] == names[b]
              else stored[region[names[a]], region[names[b]]])
      assert topo.link_cost_s[a, b] == pytest.approx(want, abs=1e-6)
  np.testing.assert_allclose(topo.forward_s, 0.44)


def test_nl_london_anomaly_kept_and_fixed_variant():
  kept, fixed = topology_lib.gcp_12_regions(), topology_lib.gcp_12_regions(
      fix_nl_london=True)
  nl, london = 6, 10   # Belgium-first order: node 6 is NL, node 10 London
  assert kept.link_cost_s[nl, london] == pytest.approx(132.314412, abs=1e-5)
  assert fixed.link_cost_s[nl, london] < 0.5


def test_presets_shapes():
  big = topology_lib.gcp_42_nodes()
  assert big.num_nodes == 42 and big.stage_sizes == (7, 5, 5, 5, 5, 5, 5, 5)
  np.testing.assert_allclose(big.forward_s, 0.165)
  flat = topology_lib.homogeneous((2, 2, 2))
  off = ~np.eye(6, dtype=bool)
  np.testing.assert_allclose(flat.link_cost_s[off], 0.5)


def test_random_topology_is_seeded():
  a = topology_lib.random_heterogeneous(7)
  b = topology_lib.random_heterogeneous(7)
  c = topology_lib.random_heterogeneous(8)
  np.testing.assert_array_equal(a.link_cost_s, b.link_cost_s)
  assert not np.array_equal(a.link_cost_s, c.link_cost_s)
  np.testing.assert_allclose(a.link_cost_s, a.link_cost_s.T)


def test_bad_topology_input():
  with pytest.raises(ValueError, match=r"stage_sizes: must sum to the number "
                     r"of nodes \(4\)"):
    topology_lib.Topology(
        node_names=("a", "b", "c", "d"), forward_s=np.ones(4),
        memory=np.ones(4, int), latency_ms=np.zeros((4, 4)),
        bandwidth_gibps=np.ones((4, 4)), stage_sizes=(2, 1),
        activation_bytes=0.0, dp_bytes=0.0)
