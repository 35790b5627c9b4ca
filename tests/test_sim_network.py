"""Cost models and the network option of lowcomm_jax.sim.network."""

import math

import pytest

from lowcomm_jax.sim import network as net_lib

GBIT_BYTES = 125e6  # 1 Gbit in bytes


def test_presets():
  assert net_lib.PRESETS["datacenter"] == net_lib.Network(400e9, 10e-6)
  assert net_lib.PRESETS["cross_region"] == net_lib.Network(10e9, 30e-3)
  assert net_lib.PRESETS["internet"] == net_lib.Network(1e9, 50e-3)
  assert net_lib.PRESETS["home"] == net_lib.Network(100e6, 30e-3)
  assert net_lib.parse_network("Internet") is net_lib.PRESETS["internet"]


@pytest.mark.parametrize("spec, bandwidth, latency", [
    ("1Gbit,50ms", 1e9, 0.05),
    ("100Mbit/s, 30ms", 100e6, 0.03),
    ("2.5gbit/s,10us", 2.5e9, 1e-5),
    ("inf,0s", math.inf, 0.0),
])
def test_parse_bandwidth_latency(spec, bandwidth, latency):
  net = net_lib.parse_network(spec)
  assert net.bandwidth_bits_per_s == pytest.approx(bandwidth)
  assert net.latency_s == pytest.approx(latency)


@pytest.mark.parametrize("spec", ["fast", "1Gbit", "1Gbyte,50ms", "0Gbit,1ms",
                                  "1Gbit,50parsecs", ""])
def test_parse_bad_input_names_option_and_forms(spec):
  with pytest.raises(ValueError, match=r"network: .*datacenter.*'1Gbit,50ms'"):
    net_lib.parse_network(spec)


def test_ring_all_reduce_closed_form():
  net = net_lib.Network(1e9, 0.01)
  # 2(M-1)/M * 1 s + 2(M-1) * 10 ms at M = 4.
  assert net_lib.ring_all_reduce_seconds(GBIT_BYTES, 4, net) == pytest.approx(1.5 + 0.06)
  assert net_lib.reduce_scatter_seconds(GBIT_BYTES, 4, net) == pytest.approx(0.75 + 0.03)
  assert net_lib.all_gather_seconds(GBIT_BYTES, 4, net) == pytest.approx(0.75 + 0.03)


def test_tree_and_pairwise_closed_forms():
  net = net_lib.Network(1e9, 0.01)
  # ceil(log2 5) = 3 levels, each crossed twice with the whole payload.
  assert net_lib.tree_all_reduce_seconds(GBIT_BYTES, 5, net) == pytest.approx(6 * 1.01)
  assert net_lib.tree_all_reduce_seconds(GBIT_BYTES, 1024, net) == pytest.approx(20 * 1.01)
  assert net_lib.pairwise_exchange_seconds(GBIT_BYTES, 2, net) == pytest.approx(1.01)
  assert net_lib.pairwise_exchange_seconds(GBIT_BYTES, 3, net) == pytest.approx(2.02)
  assert net_lib.send_seconds(GBIT_BYTES, net) == pytest.approx(1.01)


@pytest.mark.parametrize("kind", net_lib.COLLECTIVE_KINDS[:-1])
def test_one_worker_costs_nothing(kind):
  assert net_lib.collective_seconds(kind, 1e12, 1, net_lib.Network(1.0, 1.0)) == 0.0


def test_infinite_bandwidth_leaves_latency_only():
  net = net_lib.Network(math.inf, 0.05)
  assert net_lib.ring_all_reduce_seconds(1e12, 8, net) == pytest.approx(14 * 0.05)


def test_bad_kind_and_workers():
  with pytest.raises(ValueError, match="kind: .*all_reduce"):
    net_lib.collective_seconds("broadcast", 1.0, 2, net_lib.PRESETS["home"])
  with pytest.raises(ValueError, match="num_workers"):
    net_lib.ring_all_reduce_seconds(1.0, 0, net_lib.PRESETS["home"])
