"""Staleness rules of asynchronous learners: the weight a syncer gives a Δ computed from an older φ.

A learner's Δ = φ_v − θ starts from φ at version v (the number of Δ merged into φ when it took φ);
merged when φ is at version V, it is s = V − v merges stale. The rules (`elastic.staleness`,
docs/algorithms.md §1.8):

  inverse   1 / (1 + s): a stale Δ counts less the more merges it missed
  cutoff    1 up to S = `elastic.max_staleness` merges, 0 (dropped) beyond
  none      1 whatever s (naive asynchronous merging)

With every learner in step (s = 0: a barrier, or one learner) every rule is 1.
"""

from __future__ import annotations

STALENESS_RULES = ("inverse", "cutoff", "none")


def weight(rule: str, staleness: int, max_staleness: int = 0) -> float:
  """The factor of a Δ that is `staleness` merges old under `rule` (0: dropped)."""
  if staleness < 0:
    raise ValueError(f"staleness must be >= 0, got {staleness}")
  if rule == "inverse":
    return 1.0 / (1.0 + staleness)
  if rule == "cutoff":
    return 1.0 if staleness <= max_staleness else 0.0
  if rule == "none":
    return 1.0
  raise ValueError(f"elastic.staleness must be one of {', '.join(STALENESS_RULES)}, got {rule!r}")
