"""A network between workers, and what each collective costs on it.

The cost models are the standard latency-bandwidth ("alpha-beta") ones: a
message of ``b`` bits over a link of bandwidth ``B`` bit/s and latency ``ℓ``
seconds takes ``ℓ + b / B``. Every worker has one full-duplex link of that
bandwidth, so it can send and receive ``b`` bits at once in ``ℓ + b / B``.
``M`` is the number of workers taking part in the collective and ``S`` the
payload in bytes: the size of the tensor each worker contributes (before the
collective's own traffic pattern multiplies it).

| collective | seconds |
|---|---|
| ring all-reduce | 2(M−1)/M · 8S/B + 2(M−1)·ℓ |
| tree all-reduce | 2·⌈log2 M⌉ · (ℓ + 8S/B) |
| reduce-scatter, all-gather (ring) | (M−1)/M · 8S/B + (M−1)·ℓ |
| pairwise exchange (gossip, group n) | (n−1) · (ℓ + 8S/B) |
| point-to-point send | ℓ + 8S/B |

With one worker (M = 1) every collective costs 0: nothing leaves the worker.

Example:
  >>> net = parse_network("1Gbit,50ms")
  >>> round(ring_all_reduce_seconds(125e6, 2, net), 3)  # 1 Gbit at M=2
  1.1
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = [
    "Network",
    "PRESETS",
    "parse_network",
    "ring_all_reduce_seconds",
    "tree_all_reduce_seconds",
    "reduce_scatter_seconds",
    "all_gather_seconds",
    "pairwise_exchange_seconds",
    "send_seconds",
    "COLLECTIVE_KINDS",
    "collective_seconds",
]


@dataclasses.dataclass(frozen=True)
class Network:
  """One worker's link to the others.

  Attributes:
    bandwidth_bits_per_s: B, bits per second in each direction (may be
      ``math.inf``: an ideal link where only latency costs time).
    latency_s: ℓ, one-way latency of one message in seconds.
  """

  bandwidth_bits_per_s: float
  latency_s: float = 0.0

  def __post_init__(self):
    if not self.bandwidth_bits_per_s > 0:
      raise ValueError(
          f"network: bandwidth must be > 0 bit/s, got {self.bandwidth_bits_per_s}")
    if not self.latency_s >= 0:
      raise ValueError(f"network: latency must be >= 0 s, got {self.latency_s}")

  def transfer_seconds(self, num_bytes: float) -> float:
    """Seconds to push ``num_bytes`` through the link, latency excluded."""
    return 8.0 * num_bytes / self.bandwidth_bits_per_s


# The presets of issue 7: a TPU/GPU datacenter fabric, a dedicated link between
# regions, a good internet connection, a home connection.
PRESETS = {
    "datacenter": Network(400e9, 10e-6),
    "cross_region": Network(10e9, 30e-3),
    "internet": Network(1e9, 50e-3),
    "home": Network(100e6, 30e-3),
}

_BANDWIDTH_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?|inf)"
_SPEC_RE = re.compile(
    rf"^\s*{_NUMBER}\s*([a-z]*?)(?:/s)?\s*,\s*{_NUMBER}\s*([a-zµ]+)\s*$",
    re.IGNORECASE)


def parse_network(spec: "str | Network") -> Network:
  """Reads ``--config.network``: a preset name or ``"<bandwidth>,<latency>"``.

  Args:
    spec: one of ``datacenter``, ``cross_region``, ``internet``, ``home``; or a
      bandwidth with a unit in bit, kbit, Mbit, Gbit, Tbit (optionally followed
      by ``/s``) and a latency with a unit in s, ms, us, ns, e.g.
      ``"1Gbit,50ms"``, ``"100Mbit/s,30ms"``, ``"inf,0s"``. A ``Network`` is
      returned unchanged.

  Returns:
    The ``Network``.

  Raises:
    ValueError: naming the option ``network`` and the allowed forms.
  """
  if isinstance(spec, Network):
    return spec
  text = str(spec).strip()
  if text.lower() in PRESETS:
    return PRESETS[text.lower()]
  match = _SPEC_RE.match(text)
  if match:
    bw_value, bw_unit, lat_value, lat_unit = match.groups()
    # A bandwidth needs its unit, except "inf" (an ideal link).
    bw_scale = _BANDWIDTH_UNITS.get(bw_unit.lower() or
                                    ("bit" if bw_value.lower() == "inf" else ""))
    lat_scale = _LATENCY_UNITS.get(lat_unit.lower())
    if bw_scale is not None and lat_scale is not None:
      bandwidth = float(bw_value) * bw_scale
      if bandwidth > 0:
        return Network(bandwidth, float(lat_value) * lat_scale)
  raise ValueError(
      f"network: cannot read {spec!r}. Allowed: a preset "
      f"({', '.join(PRESETS)}) or '<bandwidth>,<latency>' with a bandwidth "
      f"> 0 in {'/'.join(('bit', 'kbit', 'Mbit', 'Gbit', 'Tbit'))} and a "
      "latency in s/ms/us/ns, e.g. '1Gbit,50ms'.")


def _check_workers(num_workers: int) -> int:
  if int(num_workers) != num_workers or num_workers < 1:
    raise ValueError(f"num_workers: must be an integer >= 1, got {num_workers}")
  return int(num_workers)


def ring_all_reduce_seconds(payload_bytes: float, num_workers: int,
                            network: Network) -> float:
  """Ring all-reduce (reduce-scatter then all-gather) of ``S`` bytes.

  Each of the 2(M−1) rounds moves one 1/M chunk to the next worker and pays
  one latency: ``2(M−1)/M · 8S/B + 2(M−1)·ℓ``. Bandwidth-optimal; the latency
  term grows linearly with M.
  """
  m = _check_workers(num_workers)
  return 2 * (m - 1) / m * network.transfer_seconds(payload_bytes) + (
      2 * (m - 1) * network.latency_s)


def tree_all_reduce_seconds(payload_bytes: float, num_workers: int,
                            network: Network) -> float:
  """Binary-tree all-reduce: reduce up the tree, broadcast down.

  Each of the ⌈log2 M⌉ levels is crossed twice with the whole, unpipelined
  payload: ``2·⌈log2 M⌉ · (ℓ + 8S/B)``. This is the "tree all-reduce" that
  NoLoCo compares its O(1) pairwise exchange against.
  """
  m = _check_workers(num_workers)
  levels = math.ceil(math.log2(m)) if m > 1 else 0
  return 2 * levels * (network.latency_s + network.transfer_seconds(payload_bytes))


def reduce_scatter_seconds(payload_bytes: float, num_workers: int,
                           network: Network) -> float:
  """Ring reduce-scatter: the first half of a ring all-reduce.

  ``(M−1)/M · 8S/B + (M−1)·ℓ``; each worker ends with 1/M of the sum.
  """
  return ring_all_reduce_seconds(payload_bytes, num_workers, network) / 2


def all_gather_seconds(payload_bytes: float, num_workers: int,
                       network: Network) -> float:
  """Ring all-gather of an ``S``-byte result from 1/M shards.

  ``(M−1)/M · 8S/B + (M−1)·ℓ``, the second half of a ring all-reduce.
  """
  return ring_all_reduce_seconds(payload_bytes, num_workers, network) / 2


def pairwise_exchange_seconds(payload_bytes: float, group_size: int,
                              network: Network) -> float:
  """Gossip: every worker sends its ``S`` bytes to each peer of its group.

  ``(n−1) · (ℓ + 8S/B)`` for a group of ``n``; for pairs (n = 2) one
  message, ``ℓ + 8S/B``, whatever the total number of workers. Links are
  full duplex, so the two peers' messages cross at the same time.
  """
  n = _check_workers(group_size)
  return (n - 1) * (network.latency_s + network.transfer_seconds(payload_bytes))


def send_seconds(payload_bytes: float, network: Network) -> float:
  """One point-to-point message: ``ℓ + 8S/B``."""
  return network.latency_s + network.transfer_seconds(payload_bytes)


COLLECTIVE_KINDS = ("all_reduce", "tree_all_reduce", "reduce_scatter",
                    "all_gather", "gossip", "send")


def collective_seconds(kind: str, payload_bytes: float, num_workers: int,
                       network: Network) -> float:
  """Seconds of one collective, by name.

  Args:
    kind: one of ``COLLECTIVE_KINDS``. ``all_reduce`` is the ring;
      ``gossip`` is a pairwise exchange in groups of ``num_workers`` (pass 2
      for NoLoCo's pairs); ``send`` ignores ``num_workers``.
    payload_bytes: S, the bytes each worker contributes.
    num_workers: M taking part (group size for ``gossip``).
    network: the link.

  Raises:
    ValueError: naming ``kind`` and the allowed values.
  """
  if kind == "all_reduce":
    return ring_all_reduce_seconds(payload_bytes, num_workers, network)
  if kind == "tree_all_reduce":
    return tree_all_reduce_seconds(payload_bytes, num_workers, network)
  if kind == "reduce_scatter":
    return reduce_scatter_seconds(payload_bytes, num_workers, network)
  if kind == "all_gather":
    return all_gather_seconds(payload_bytes, num_workers, network)
  if kind == "gossip":
    return pairwise_exchange_seconds(payload_bytes, num_workers, network)
  if kind == "send":
    return send_seconds(payload_bytes, network)
  raise ValueError(f"kind: unknown collective {kind!r}; allowed: "
                   f"{', '.join(COLLECTIVE_KINDS)}")
