"""A run's collectives as the virtual clock sees them (`lowcomm_jax.sim.clock`).

Clock steps are 0-based. A blocking collective taken after step t (τ = 0) is issued at clock step
t−1 and consumed at t. Streaming DiLoCo's overlapped reduce is issued from the parameters entering
step s, i.e. ready when step s−1 ends: clock step s−2, consumed τ steps later (s−2+1+τ). Data
parallel's gradient all-reduce is counted as blocking every step (its overlap with the backward is
not modelled); NoLoCo's pairwise exchange blocks the step after its outer step.
"""

from __future__ import annotations

from typing import Callable

from lowcomm_jax.sim import clock


def comm_events(algorithm, data_workers: int, num_params: int, num_steps: int,
                entries_of: Callable) -> list[clock.CommEvent]:
  """`entries_of(phase)` gives the ledger entries of a phase's program (`Trainer.phase_entries`)."""
  if algorithm.gossip:
    return [clock.CommEvent(step - 1, step, e.payload_bytes, "gossip", e.num_workers)
            for step in range(1, num_steps)
            if algorithm.phase_at(step).grouping is not None
            for e in entries_of(algorithm.phase_at(step))]
  if not algorithm.phased:
    if data_workers == 1:
      return []
    return [clock.CommEvent(s, s + 1, 4 * num_params, "all_reduce", data_workers)
            for s in range(num_steps - 1)]
  events, delay = [], algorithm.tx.schedule.delay
  for step in range(1, num_steps + 1):
    phase = algorithm.phase_at(step)
    if not phase.send:
      continue
    by_name = {e.name: e for e in entries_of(phase)}
    for p in phase.send:
      entry, tau = by_name[f"fragment {p}"], int(delay[p])
      issued = step - 2 if tau else step - 1
      if issued + 1 + tau <= num_steps:  # a result consumed after the last step is never waited for
        events.append(clock.CommEvent(issued, issued + 1 + tau, entry.payload_bytes, "all_reduce",
                                      entry.num_workers))
  return events
