"""The fragment schedule as data: one row per fragment (period H, offset, delay τ, merge α).

Steps are counted from 1 (step s is the s-th inner step). Fragment p's outer
gradient is taken after inner step t for every t ≥ offset_p with
(t − offset_p) % H == 0. With τ = 0 it is reduced and applied at once (after
step t's inner update). With τ ≥ 1 its all-reduce is issued in step t+1's
program from the parameters entering that step, so it does not depend on
step t+1's forward and backward and XLA may overlap the two; the result is
applied after inner step t+τ, merged as θ ← α·θ_local + (1−α)·θ_global.
Staggered offsets are offset_p = (p+1)·H/P (the last fragment syncs at H),
so one fragment is in flight every H/P steps; unstaggered offsets are all H.

Where the overlap sits around the nominal sync step n_p = offset_p + kH
(`overlap_anchor`, config key `outer.overlap_anchor`):

  anchor | Δ taken after step | all-reduce issued with step | merged after step
  send   | n                  | n + 1                       | n + τ     (the paper's, the default)
  apply  | n − τ              | n − τ + 1                   | n         (torchft's convention)

`apply` is `send` with every offset moved τ steps earlier (the row's `offset`
is always the step whose parameters are sent); with τ = 0 both are the same.

Eager (`outer.eager`, docs/algorithms.md §1.7): τ = D·H with D = 1 or 2 outer steps in flight, so
fragment p's mean lands D sync steps after it was sent; every sync step (the first included, before
anything has landed) receives and runs p's outer step, with the worker's own fresh Δ_p standing in
for its share of the mean. With D = 2 two means of p are in flight at once: fragment p has D lanes,
lane j holding the sends of p's outer steps k with k % D = j. A phase names lanes as slots
q = p + F·j (F fragments); with D = 1 the slot is the fragment.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from lowcomm_jax import checks


class FragmentSchedule(NamedTuple):
  """Rows per fragment: period (H), offset, delay (τ), alpha (α), eager."""

  period: np.ndarray  # int[F]
  offset: np.ndarray  # int[F], in [1, H]: the first step whose parameters fragment p sends
  delay: np.ndarray  # int[F]
  alpha: np.ndarray  # float[F]
  eager: np.ndarray  # bool[F]: every sync step runs the outer step with the eager proxy (τ = D·H)

  @property
  def num_fragments(self) -> int:
    return len(self.period)

  @property
  def lanes(self) -> int:
    """D: the outer steps of one fragment in flight at once (τ // H with eager, else 1)."""
    return max(1, int((self.delay // self.period)[self.eager].max(initial=1)))

  @property
  def num_slots(self) -> int:
    """F·D: the slots a phase names (fragment p's lane j is slot p + F·j)."""
    return self.num_fragments * self.lanes

  @property
  def cycle(self) -> int:
    """Steps after which the phases repeat: D·H."""
    return int(self.period.max()) * self.lanes


class Phase(NamedTuple):
  """What one step's program does: slots (fragments, or with D > 1 a fragment's lane) whose reduce
  starts, slots whose mean gets applied."""

  send: tuple[int, ...] = ()
  receive: tuple[int, ...] = ()


OVERLAP_ANCHORS = ("send", "apply")


def make_schedule(num_fragments: int, sync_every: int, overlap_steps: int = 0,
                  merge_alpha: float = 0.0, staggered: bool = True,
                  overlap_anchor: str = "send", eager: bool = False) -> FragmentSchedule:
  """The Streaming DiLoCo schedule; one clear ValueError per bad option, before any compute.

  `overlap_anchor`: "send" sends at the nominal sync step and merges τ steps later (the paper's);
  "apply" sends τ steps before the nominal step and merges at it (torchft's), see the table above.
  The messages name the `outer` keys. Built once per distinct arguments (the config's check and
  the algorithm share it); its arrays are read-only.
  """
  return _schedule(num_fragments, sync_every, overlap_steps, merge_alpha, staggered,
                   overlap_anchor, bool(eager))


@functools.lru_cache(maxsize=64, typed=True)  # typed: True is not 1 (H=True is refused)
def _schedule(num_fragments, sync_every, overlap_steps, merge_alpha, staggered,
              overlap_anchor, eager) -> FragmentSchedule:
  if overlap_anchor not in OVERLAP_ANCHORS:
    raise ValueError(f"outer.overlap_anchor must be one of {OVERLAP_ANCHORS}, "
                     f"got {overlap_anchor!r}")
  if num_fragments < 1:
    raise ValueError(f"outer.num_fragments (P) must be >= 1, got {num_fragments}")
  sync_every = checks.sync_every(sync_every, "outer.sync_every",
                                 num_fragments=num_fragments if staggered else 1)
  stride = sync_every // num_fragments if staggered else sync_every
  if eager:
    if overlap_steps not in (sync_every, 2 * sync_every):
      raise ValueError(f"outer.eager needs outer.overlap_steps (τ) = outer.sync_every (H = "
                       f"{sync_every}) or 2H = {2 * sync_every}: a fragment's mean lands one or "
                       f"two sync steps later; got τ={overlap_steps}")
    if overlap_anchor != "send":
      raise ValueError("outer.eager needs outer.overlap_anchor='send' (its outer step runs at the "
                       "sync step that sends)")
  elif overlap_steps < 0 or (overlap_steps and overlap_steps >= stride):
    raise ValueError(f"outer.overlap_steps (τ={overlap_steps}) must be >= 0 and smaller than "
                     f"H/P = {stride} so that one fragment is in flight at a time")
  if not 0.0 <= merge_alpha <= 1.0:
    raise ValueError(f"outer.merge_alpha (α) must be in [0, 1], got {merge_alpha}")
  # τ < H/P keeps the earliest "apply" send, (p+1)·H/P − τ, at step 1 or later.
  shift = overlap_steps if overlap_anchor == "apply" else 0
  offsets = [((p + 1) * stride if staggered else sync_every) - shift for p in range(num_fragments)]
  rows = (np.full(num_fragments, sync_every), np.asarray(offsets),
          np.full(num_fragments, overlap_steps), np.full(num_fragments, float(merge_alpha)),
          np.full(num_fragments, eager))
  for row in rows:
    row.flags.writeable = False
  return FragmentSchedule(*rows)


def _synced_after(schedule: FragmentSchedule, q: int, t: int) -> bool:
  """Whether slot q (fragment p = q % F, lane j = q // F) syncs after step t: p's sync steps
  offset_p + k·H with k % D = j."""
  p, j = q % schedule.num_fragments, q // schedule.num_fragments
  first, every = schedule.offset[p] + j * schedule.period[p], schedule.period[p] * schedule.lanes
  return t >= first and (t - first) % every == 0


def phase_at(schedule: FragmentSchedule, step: int) -> Phase:
  """The phase of inner step `step` (1-based): read on the host to pick the compiled program."""
  send, receive = [], []
  for q in range(schedule.num_slots):
    p = q % schedule.num_fragments
    tau = int(schedule.delay[p])
    if _synced_after(schedule, q, step - 1 if tau else step):
      send.append(q)
    if _synced_after(schedule, q, step if schedule.eager[p] else step - tau):
      receive.append(q)
  return Phase(tuple(send), tuple(receive))


def phase_table(schedule: FragmentSchedule) -> tuple[list[Phase], np.ndarray, int]:
  """All distinct phases, and a lookup from step to phase index.

  After step S0 = max(offset) + max(delay) + 1 the phases repeat with period C = D·H
  (`FragmentSchedule.cycle`), so a table of S0 + C − 1 entries and
  `index(s) = s if s < S0 else S0 + (s − S0) % C` cover every step with a bounded number of
  programs.

  Returns:
    (phases, table, s0) where table[s − 1] is the phase index of step s < S0 + C.
  """
  period = schedule.cycle
  s0 = int(schedule.offset.max() + schedule.delay.max()) + 1
  phases, table = [], []
  for s in range(1, s0 + period):
    ph = phase_at(schedule, s)
    if ph not in phases:
      phases.append(ph)
    table.append(phases.index(ph))
  return phases, np.asarray(table, np.int32), s0


def without_delayed(delay, phase: Phase) -> Phase:
  """`phase` without the overlapped (τ ≥ 1) fragments' sends and merges: what a step's program runs
  when the outer-communication thread carries those (`train.overlap`). `delay` is per fragment;
  slot q is fragment q % F's."""
  kept = lambda slots: tuple(q for q in slots if not delay[q % len(delay)])
  return Phase(kept(phase.send), kept(phase.receive))
