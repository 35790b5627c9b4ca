"""A virtual clock: the wall time a run would take on a declared network.

The model, chosen to be computable by hand:

* Step ``s`` computes for ``c_s`` seconds without interruption.
* A collective issued at step ``s`` becomes ready at the end of step ``s``'s
  compute (or, for the per-layer simulator, ``ready_after_s`` seconds after
  the step began). It then runs in the background on the worker's single
  link, which serves one collective at a time and never interrupts one: a
  collective starts when it is ready and the link is free, and holds the link
  for its duration (``network.collective_seconds``). Which of several waiting
  collectives goes first is the link's *order*: ``"fifo"`` (the default, the
  order a program issues them: ``max(ready, previous finish)``) or
  ``"deadline"`` (the one a step needs soonest: smallest consumed step, then
  smallest ``needed_after_s``), which lets the first layers' reductions
  overtake the others so the next forward can start under the rest.
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

import heapq
from typing import Iterable, NamedTuple, Sequence

from lowcomm_jax.sim import network as network_lib

__all__ = ["CommEvent", "Transfer", "Timeline", "LINK_ORDERS", "run_timeline",
           "simulate_run"]


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


# How the link picks among waiting collectives (see the module docstring).
LINK_ORDERS = ("fifo", "deadline")


def run_timeline(step_seconds: "float | Sequence[float]",
                 transfers: Iterable[Transfer],
                 num_steps: int | None = None,
                 order: str = "fifo") -> Timeline:
  """Plays the clock over steps and already-priced transfers.

  Args:
    step_seconds: compute seconds per step (one number for all steps, or one
      per step).
    transfers: the collectives, in any order. Ties on the link (same ready
      time, same priority) are served in the order given.
    num_steps: number of steps; required if ``step_seconds`` is a number.
    order: ``"fifo"`` serves waiting transfers in issue order (issued step,
      then ready time); ``"deadline"`` serves the one needed soonest
      (consumed step, then ``needed_after_s``). Neither interrupts a transfer
      once started.

  Returns:
    The ``Timeline``.

  Raises:
    ValueError: on an unknown ``order``; on a transfer consumed at or before
      the step that issues it, issued outside the run, or ready after its
      step's compute has ended; and, for ``"deadline"``, on a step that
      issues a transfer before it has used every transfer it consumes (ready
      earlier than another's ``needed_after_s``), which this engine does not
      order.
  """
  if order not in LINK_ORDERS:
    raise ValueError(f"order: must be one of {', '.join(LINK_ORDERS)}, got {order!r}")
  times = _step_times(step_seconds, num_steps)
  n = len(times)
  by_step: list[list[tuple[float, int]]] = [[] for _ in range(n)]
  # Transfers consumed at each step (index n: at or after the end).
  consumed_at: list[list[int]] = [[] for _ in range(n + 1)]
  seconds, needed, priority = [], [], []
  for index, tr in enumerate(transfers):
    s = tr.issued_step
    if not 0 <= s < n:
      raise ValueError(f"issued_step: {s} outside the run's steps 0..{n - 1}")
    if tr.consumed_step <= s:
      raise ValueError(f"consumed_step: must be > issued_step, got "
                       f"{tr.consumed_step} <= {s}")
    ready = times[s] if tr.ready_after_s is None else tr.ready_after_s
    if not 0 <= ready <= times[s] * (1 + 1e-12):
      raise ValueError(f"ready_after_s: {ready} outside the step's compute "
                       f"[0, {times[s]}]")
    ready = min(ready, times[s])
    # Used from the start of the consumed step when that step is beyond the run.
    need = tr.needed_after_s if tr.consumed_step < n else 0.0
    by_step[s].append((ready, index))
    consumed_at[min(tr.consumed_step, n)].append(index)
    seconds.append(tr.seconds)
    needed.append(need)
    priority.append((s, ready, index) if order == "fifo" else
                    (tr.consumed_step, need, s, ready, index))
  for step in by_step:
    step.sort()
  if order == "deadline":
    # The engine settles every transfer a step consumes before it releases
    # that step's own transfers, so a step must not issue one before using
    # all it consumes.
    for s in range(n):
      if by_step[s] and consumed_at[s] and (
          by_step[s][0][0] < max(needed[i] for i in consumed_at[s])):
        raise ValueError(f"order: 'deadline' needs step {s}'s transfers ready after "
                         "every needed_after_s of the transfers it consumes")

  count = len(seconds)
  finish: list[float | None] = [None] * count
  ready_at = [0.0] * count
  # Issued transfers in order of ready time (steps release theirs in time
  # order), and a priority queue of those ready and waiting for the link.
  issued: list[int] = []
  next_issued = 0
  waiting: list[tuple] = []
  link_free = 0.0

  def serve_until(item: int) -> None:
    """Runs the link, one transfer at a time, until ``item`` has finished."""
    nonlocal link_free, next_issued
    while finish[item] is None:
      # Whatever is ready when the link frees up competes for it; if nothing
      # is, the link idles until the next transfer is ready.
      until = link_free
      if not waiting:
        until = max(until, ready_at[issued[next_issued]])
      while next_issued < len(issued) and ready_at[issued[next_issued]] <= until:
        chosen = issued[next_issued]
        heapq.heappush(waiting, (priority[chosen], chosen))
        next_issued += 1
      _, chosen = heapq.heappop(waiting)
      link_free = max(link_free, ready_at[chosen]) + seconds[chosen]
      finish[chosen] = link_free

  starts, ends, stalls = [], [], []
  prev_end = 0.0
  for s in range(n + 1):
    # A step may start once each transfer it consumes finishes by the time
    # its compute reaches the point that uses it.
    start = prev_end
    for item in consumed_at[s]:
      serve_until(item)
      start = max(start, finish[item] - needed[item])
    starts.append(start)
    if s == n:
      break
    stalls.append(start - prev_end)
    for ready, item in by_step[s]:
      ready_at[item] = start + ready
      issued.append(item)
    prev_end = start + times[s]
    ends.append(prev_end)
  for item in range(count):
    serve_until(item)
  return Timeline(
      wall_seconds=max([prev_end] + finish),
      compute_seconds=sum(times),
      step_start=starts,
      step_end=ends,
      stall_seconds=stalls,
      comm_seconds=sum(seconds),
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
