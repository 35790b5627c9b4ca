"""What an outer algorithm sends: a `Plan` per named tree, and the three parts of its outer step.

An algorithm declares, for each phase (a hashable value the host reads per step), the trees it sends
and how each travels; `comm.dispatch.carry` is the one place that runs a plan. The outer step is
three pure parts around it:

  plans(phase)                        -> {name: Plan}: what this phase sends
  local(state, params, phase)         -> {name: tree}: the trees to send (no collective)
  apply(state, params, incoming, phase) -> (params, state): `incoming` holds the carried result of
                                         every name this phase consumes (`consumes(phase)`)

Inline (`compose`), a step program runs local → carry → apply. With the outer-communication thread
(`train.overlap`) the loop computes `local` itself, hands each plan with delay τ ≥ 1 and its tree to
`comm.OuterCommExecutor`, writes the results into the state's `CommState` and runs `apply` later.

Delay τ: 0 — carried and consumed inside the step that takes the tree (after its inner update);
k ≥ 1 — the tree is taken from the parameters entering step s+1 (so its collective does not wait
for that step's backward), carried while steps s+1 … s+τ run, and consumed after step s+τ. The
result waits in `CommState.in_flight[name]` (the same on every replica for the mean-like kinds).

Error feedback: each replica keeps `CommState.residuals[name]`, what its encoding dropped; before
the next send e ← β·e + Δ (β = `feedback_decay`; 1.0 is the plain residual) is what is encoded.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, runtime_checkable

KINDS = ("mean", "compressed_mean", "group_mean", "sparse_gather")

# The virtual clock's cost model for each kind (`sim.network.COLLECTIVE_KINDS`).
CLOCK_KINDS = {"mean": "all_reduce", "compressed_mean": "all_reduce", "group_mean": "gossip",
               "sparse_gather": "all_gather"}


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """How one named tree travels over the replica axis.

  Attributes:
    kind: "mean" (float32 all-reduce), "compressed_mean" (codec-encoded reduce-scatter +
      all-gather, float32 accumulation), "group_mean" (point-to-point mean within groups of
      `groupings`) or "sparse_gather" (all-gather of a sparse encoding, averaged by scatter-add).
    codec: a `lowcomm_jax.codecs.Codec` (compressed_mean, optionally group_mean) or the sparse
      compressor (sparse_gather); None for float32.
    delay: τ, steps the collective overlaps before its result is consumed (see the module doc).
    error_feedback: keep a per-replica residual of what the encoding dropped.
    feedback_decay: β in e ← β·e + Δ (1.0: the plain residual).
    kernels: the codec's encode/decode (one of `codecs.KERNEL_MODES`).
    groupings: for group_mean, int[K, M // n, n]: the pool of partitions; the step program picks
      one with an index (`carry(..., grouping=)`).
    seed: stochastic rounding's key is fold_in(key(seed), count), the same on every replica.
  """

  kind: str
  codec: Any = None
  delay: int = 0
  error_feedback: bool = False
  feedback_decay: float = 1.0
  kernels: str = "auto"
  groupings: Any = None
  seed: int = 0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"plan kind must be one of {KINDS}, got {self.kind!r}")
    if self.error_feedback and self.codec is None:
      raise ValueError("error feedback needs a lossy codec (the plan has codec=None)")
    if self.kind in ("compressed_mean", "sparse_gather") and self.codec is None:
      raise ValueError(f"plan kind {self.kind} needs a codec")
    if self.kind == "group_mean" and self.groupings is None:
      raise ValueError("plan kind group_mean needs its groupings")

  def issued_at(self, step: int) -> int:
    """The step whose program issues the collective of a tree taken after step `step`."""
    return step + 1 if self.delay else step

  def consumed_at(self, step: int) -> int:
    """The step after which the result of a tree taken after step `step` is applied."""
    return step + self.delay

  @property
  def clock_kind(self) -> str:
    return CLOCK_KINDS[self.kind]

  def clock_bytes(self, payload_bytes: int, num_workers: int) -> int:
    """The size the clock's cost model of `clock_kind` takes: the payload of one worker, except
    for the all-gather, whose model takes the gathered result (M payloads)."""
    return payload_bytes * num_workers if self.clock_kind == "all_gather" else payload_bytes


class CommState(NamedTuple):
  """The dispatcher's part of an algorithm's state, keyed by plan name.

  in_flight: name -> the carried result while in flight (τ ≥ 1): the same on every replica.
  residuals: name -> this replica's error-feedback residual (per replica).
  """

  in_flight: dict
  residuals: dict


COMM_STATE_AXES = CommState(in_flight=None, residuals=0)


@runtime_checkable
class OuterStep(Protocol):
  """An algorithm's outer step as plans and two pure parts (see the module doc).

  Besides `plans`, `local` and `apply`, the loop reads `phases` (every phase the algorithm runs),
  `consumes(phase)` (the names whose results `apply` takes in that phase) and
  `without_delayed(phase)` (the phase a step program runs when the communication thread carries
  the plans with τ ≥ 1); its state has a `comm` field (`CommState`) and `state_axes` its vmap axes.
  """

  phases: tuple
  state_axes: Any

  def plans(self, phase) -> dict[str, Plan]:
    ...

  def local(self, state, params, phase) -> dict:
    ...

  def apply(self, state, params, incoming: dict, phase):
    ...

  def consumes(self, phase) -> tuple:
    ...

  def without_delayed(self, phase):
    ...


def clock_events(num_steps: int, phase_at, plans_at, entries_of) -> list[tuple]:
  """The virtual clock's events (`sim.clock.CommEvent` fields, as tuples) of a plan-based run.

  Clock steps are 0-based. A tree taken after step t with τ = 0 is carried at clock step t−1 and
  consumed at t. With τ ≥ 1 it is taken from the parameters entering step s = t+1, i.e. ready when
  step s−1 ends (clock step s−2), and consumed τ steps later (s−2+1+τ). Each plan's bytes are its
  ledger entries (`Entry.plan == name`) in the program of the phase that sends it.

  Args:
    num_steps: the run's steps.
    phase_at: step (1-based) -> phase.
    plans_at: phase -> {name: Plan} sent in that phase's program.
    entries_of: phase -> the ledger entries of that phase's program.
  """
  events = []
  for step in range(1, num_steps + 1):
    phase = phase_at(step)
    plans = plans_at(phase)
    if not plans:
      continue
    entries = entries_of(phase)
    for name, plan in plans.items():
      issued = step - 2 if plan.delay else step - 1
      if issued + 1 + plan.delay > num_steps:  # consumed after the last step: never waited for
        continue
      for e in entries:
        if e.plan == name:
          events.append((issued, issued + 1 + plan.delay,
                         plan.clock_bytes(e.payload_bytes, e.num_workers), plan.clock_kind,
                         e.num_workers))
  return events


def shared_part(axes, state):
  """`state` with its per-replica fields (vmap axis 0 in `axes`, the algorithm's `state_axes`) set
  to None: what is the same on every replica (the global parameters, the outer optimizer's state).
  """
  if axes is None:
    return state
  if axes == 0:
    return None
  return type(state)(*(shared_part(a, s) for a, s in zip(axes, state)))


def with_shared(axes, state, shared):
  """`state` (one replica's, or replicated) with the fields of `shared_part` taken from `shared`."""
  if axes is None:
    return shared
  if axes == 0:
    return state
  return type(state)(*(with_shared(a, s, h) for a, s, h in zip(axes, state, shared)))
