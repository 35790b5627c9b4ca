"""The grace window of a fragment round: how long a round with its quorum waits for the others.

A round of fragment p that holds `min(min_quorum, live)` Δ_p waits for the live learners still
missing. With a fixed window (`elastic.adaptive_grace=False`) it waits `elastic.grace_s` seconds
from the moment its quorum was reached, and closes earlier only if every live learner sent.

The adaptive window (`elastic.adaptive_grace=True`) waits only for learners that are expected in
time. The syncer records when each learner's Δ_p arrives (`Arrivals.arrived`, late ones included).
A learner's next arrival is predicted as its last arrival plus its period, the median of its last
inter-arrival intervals (its H steps plus its wait, as this machine and this network run it). The
window then ends at the latest `prediction + slack · period` among the missing learners whose
prediction falls inside the cap (quorum time + `grace_s`) and is not already past:

  - a learner whose next Δ is due soon is waited for, a little beyond its prediction;
  - a straggler predicted beyond the cap, or a learner overdue (stopped, dead but not yet seen by
    Ray), costs nobody any wait: the round closes as soon as the quorum is in;
  - a learner without two arrivals yet (just started or rejoined) cannot be predicted: the round
    waits for it up to the cap, as the fixed window does;
  - with `elastic.late=drop`, a learner whose next Δ_p starts from an older φ_p than the open
    round's (it fell a round behind) is not waited for: its Δ_p would be dropped (the syncer leaves
    it out of `missing`).

The cap keeps the adaptive window's worst case the fixed window's.
"""

from __future__ import annotations

import collections
import statistics

# the part of a learner's period it may arrive after its prediction and still be waited for:
# step times vary by a few per cent between rounds on a quiet host, more on a shared one
SLACK = 0.25
# inter-arrival intervals a period is the median of: a few, so that a learner slowed down (or
# sped up) is predicted from its new pace within a few rounds
HISTORY = 4


class Arrivals:
  """When each learner's Δ_p arrived, per fragment; predicts the next arrival (see the module
  doc)."""

  def __init__(self):
    self._times = collections.defaultdict(lambda: collections.deque(maxlen=HISTORY + 1))

  def arrived(self, fragment: int, learner: int, t: float) -> None:
    self._times[(fragment, learner)].append(t)

  def forget(self, learner: int) -> None:
    """A learner left or died: its next life's pace is its own (a rejoin is not an arrival)."""
    for key in [k for k in self._times if k[1] == learner]:
      del self._times[key]

  def period(self, fragment: int, learner: int) -> float | None:
    times = list(self._times.get((fragment, learner), ()))
    if len(times) < 2:
      return None
    return statistics.median(b - a for a, b in zip(times, times[1:]))

  def predicted(self, fragment: int, learner: int) -> tuple[float, float] | None:
    """(the next arrival's predicted time, the period), or None without two arrivals."""
    period = self.period(fragment, learner)
    if period is None:
      return None
    return self._times[(fragment, learner)][-1] + period, period


def window_end(quorum_at: float, grace_s: float, now: float, missing, predicted) -> float:
  """The time a round that reached its quorum at `quorum_at` closes, waiting for the learners in
  `missing` (live, not yet sent); `predicted(learner)` is `Arrivals.predicted` for this fragment,
  or None for the fixed window (wait the whole `grace_s`)."""
  cap = quorum_at + grace_s
  if predicted is None:
    return cap
  end = now
  for learner in missing:
    guess = predicted(learner)
    if guess is None:  # no pace known yet: it may well come in time
      return cap
    due, period = guess
    expected = due + SLACK * period
    if now < expected and due <= cap:  # due in time, not overdue
      end = max(end, min(expected, cap))
  return end
