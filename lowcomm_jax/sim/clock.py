"""A virtual clock: the wall time a run would take on a declared network.

The model, chosen to be computable by hand:

* Step ``s`` computes for ``c_s`` seconds without interruption.
* A collective issued at step ``s`` becomes ready at the end of step ``s``'s
  compute (or, for the per-layer simulator, ``ready_after_s`` seconds after
  the step began). It then runs in the background on the worker's single
  link. Collectives queue first-in first-out on that link: one starts at
  ``max(ready, previous finish)`` and holds the link for its duration
  (``network.collective_seconds``).
* A collective consumed at step ``k`` blocks the *start* of step ``k`` if it
  has not finished: ``start_k = max(end_{k-1}, finish of every collective
  with consumed_step <= k)``. Overlap τ means ``consumed_step = issued_step +
  1 + τ``; τ = 0 is blocking (the next step waits).
* The run ends when its last step has ended and every collective has
  finished.

So with step time ``c`` and one all-reduce of duration ``d`` issued at step
0, three steps take ``3c + d`` when it is blocking (consumed at step 1) and
``3c + max(0, d - c)`` with τ = 1 (consumed at step 2).

Events from the Trainer are ``CommEvent(issued_step, consumed_step,
payload_bytes, kind, num_workers)``, or plain tuples in that order.
``payload_bytes`` is the size of the tensor each worker contributes (after
encoding: a 4-bit code of N values is N/2 bytes plus scales), not the wire
traffic; the collective's cost model (``network.py``) turns it into seconds.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

from lowcomm_jax.sim import network as network_lib

__all__ = ["CommEvent", "Transfer", "Timeline", "run_timeline", "simulate_run"]


class CommEvent(NamedTuple):
  """One collective of a real run, as the Trainer's ledger records it.

  Attributes:
    issued_step: the step after whose compute the collective starts.
    consumed_step: the first step that needs its result; it must be greater
      than ``issued_step`` (``issued_step + 1`` is blocking, ``+ 1 + τ``
      overlapped by τ steps).
    payload_bytes: bytes each worker contributes (the encoded tensor size).
    kind: a name in ``network.COLLECTIVE_KINDS`` (``all_reduce`` is a ring).
    num_workers: M taking part (the group size for ``gossip``).
  """

  issued_step: int
  consumed_step: int
  payload_bytes: float
  kind: str
  num_workers: int


class Transfer(NamedTuple):
  """A collective already priced in seconds (the engine's input).

  Attributes:
    issued_step: step whose compute produces the payload.
    consumed_step: first step that waits for it (> issued_step).
    seconds: how long it holds the link.
    ready_after_s: seconds after the start of ``issued_step`` at which it can
      start; ``None`` means at the end of that step's compute.
    needed_after_s: seconds into ``consumed_step``'s compute at which its
      result is first used (0: at the start). The step's compute is one
      sequence, so waiting there equals starting the step
      ``finish − needed_after_s`` at the earliest.
  """

  issued_step: int
  consumed_step: int
  seconds: float
  ready_after_s: float | None = None
  needed_after_s: float = 0.0


class Timeline(NamedTuple):
  """Result of a simulated run.

  Attributes:
    wall_seconds: when the last step has ended and every collective finished.
    compute_seconds: sum of the per-step compute times.
    step_start: start of each step; one extra entry, the time step
      ``num_steps`` could start (after the collectives it consumes).
    step_end: end of each step's compute.
    stall_seconds: per step, the time it waited on the link before starting.
    comm_seconds: total time the link was busy.
  """

  wall_seconds: float
  compute_seconds: float
  step_start: list[float]
  step_end: list[float]
  stall_seconds: list[float]
  comm_seconds: float

  @property
  def compute_utilization(self) -> float:
    return self.compute_seconds / self.wall_seconds if self.wall_seconds else 1.0


def _step_times(step_seconds: "float | Sequence[float]",
                num_steps: int | None) -> list[float]:
  if isinstance(step_seconds, (int, float)):
    if num_steps is None:
      raise ValueError("num_steps: required when step_seconds is one number")
    times = [float(step_seconds)] * int(num_steps)
  else:
    times = [float(t) for t in step_seconds]
    if num_steps is not None and num_steps != len(times):
      raise ValueError(f"num_steps: {num_steps} differs from the "
                       f"{len(times)} step times given")
  if any(t < 0 for t in times):
    raise ValueError("step_seconds: compute times must be >= 0")
  return times


def run_timeline(step_seconds: "float | Sequence[float]",
                 transfers: Iterable[Transfer],
                 num_steps: int | None = None) -> Timeline:
  """Plays the clock over steps and already-priced transfers.

  Args:
    step_seconds: compute seconds per step (one number for all steps, or one
      per step).
    transfers: the collectives, in any order. Ties on the link (same ready
      time) are served in the order given.
    num_steps: number of steps; required if ``step_seconds`` is a number.

  Returns:
    The ``Timeline``.

  Raises:
    ValueError: on a transfer consumed at or before the step that issues it,
      issued outside the run, or ready after its step's compute has ended.
  """
  times = _step_times(step_seconds, num_steps)
  n = len(times)
  by_step: list[list[tuple[float, int, Transfer]]] = [[] for _ in range(n)]
  for order, tr in enumerate(transfers):
    if not 0 <= tr.issued_step < n:
      raise ValueError(f"issued_step: {tr.issued_step} outside the run's "
                       f"steps 0..{n - 1}")
    if tr.consumed_step <= tr.issued_step:
      raise ValueError(f"consumed_step: must be > issued_step, got "
                       f"{tr.consumed_step} <= {tr.issued_step}")
    ready = times[tr.issued_step] if tr.ready_after_s is None else tr.ready_after_s
    if not 0 <= ready <= times[tr.issued_step] * (1 + 1e-12):
      raise ValueError(f"ready_after_s: {ready} outside the step's compute "
                       f"[0, {times[tr.issued_step]}]")
    by_step[tr.issued_step].append((ready, order, tr))

  # Latest finish among transfers consumed at each step (index n: at or after
  # the end). Every transfer consumed at step k was issued before k, so it is
  # in place when step k starts.
  wait_until = [0.0] * (n + 1)
  link_free = 0.0
  comm = 0.0
  starts, ends, stalls = [], [], []
  prev_end = 0.0
  last_finish = 0.0
  for s in range(n):
    start = max(prev_end, wait_until[s])
    starts.append(start)
    stalls.append(start - prev_end)
    # FIFO: within a step by ready time; across steps by step order, which is
    # time order because every transfer is ready before its step ends.
    for ready, _, tr in sorted(by_step[s], key=lambda item: item[:2]):
      begin = max(link_free, start + ready)
      link_free = begin + tr.seconds
      comm += tr.seconds
      last_finish = max(last_finish, link_free)
      slot = min(tr.consumed_step, n)
      needed = tr.needed_after_s if tr.consumed_step < n else 0.0
      wait_until[slot] = max(wait_until[slot], link_free - needed)
    prev_end = start + times[s]
    ends.append(prev_end)
  starts.append(max(prev_end, wait_until[n]))
  return Timeline(
      wall_seconds=max(prev_end, last_finish),
      compute_seconds=sum(times),
      step_start=starts,
      step_end=ends,
      stall_seconds=stalls,
      comm_seconds=comm,
  )


def simulate_run(step_seconds: "float | Sequence[float]",
                 events: Iterable["CommEvent | tuple"],
                 network: "network_lib.Network | str",
                 num_steps: int | None = None) -> Timeline:
  """Simulated wall time of a real run on ``network``.

  Args:
    step_seconds: per-step compute seconds (measured, or FLOPs / (peak · MFU));
      one number for every step or a sequence with one entry per step.
    events: ``CommEvent``s or tuples ``(issued_step, consumed_step,
      payload_bytes, kind, num_workers)``. If the ledger holds bytes already
      on the wire, pass them with kind ``send`` (ℓ + 8·bytes/B).
    network: a ``Network`` or a spec for ``network.parse_network``.
    num_steps: number of steps if ``step_seconds`` is one number.

  Returns:
    The ``Timeline``; ``wall_seconds`` is the simulated wall time.

  Example:
    >>> net = network_lib.Network(1e9, 0.0)
    >>> # 1 Gbit all-reduce between 2 workers takes 1 s; 3 steps of 2 s.
    >>> simulate_run(2.0, [(0, 1, 125e6, "all_reduce", 2)], net, 3).wall_seconds
    7.0
    >>> simulate_run(2.0, [(0, 2, 125e6, "all_reduce", 2)], net, 3).wall_seconds
    6.0
  """
  net = network_lib.parse_network(network)
  transfers = []
  for event in events:
    ev = CommEvent(*event)
    seconds = network_lib.collective_seconds(
        ev.kind, ev.payload_bytes, ev.num_workers, net)
    transfers.append(Transfer(ev.issued_step, ev.consumed_step, seconds))
  return run_timeline(step_seconds, transfers, num_steps)
