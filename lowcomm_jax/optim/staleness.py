"""Staleness rules of asynchronous learners: the weight a syncer gives a Δ computed from an older φ.

A learner's Δ = φ_v − θ starts from φ at version v (the number of Δ merged into φ when it took φ);
merged when φ is at version V, it is s = V − v merges stale. With L learners each sending in turn,
s ≈ L − 1 merges is every Δ's lot in an asynchronous run; what marks a straggler is being whole
rounds behind, r = ⌊s / L⌋ (a round: one Δ from every learner). The rules (`elastic.staleness`,
docs/algorithms.md §1.8) weigh r:

  inverse   1 / (1 + r): a Δ counts less the more rounds it missed
  cutoff    1 up to S = `elastic.max_staleness` rounds, 0 (dropped) beyond
  none      1 whatever r (naive asynchronous merging)
  heloco    1 / (1 + r), as inverse, and each Δ aligned block by block with the outer momentum
            before the outer step (`optim.alignment.heloco`, which the elastic options wrap the
            syncer's outer optimizer in)

With every learner in step (r = 0: learners of one speed, a barrier, or one learner) every rule
is 1.
"""

from __future__ import annotations

STALENESS_RULES = ("inverse", "cutoff", "none", "heloco")


def rounds_behind(staleness: int, num_learners: int) -> int:
  """r = ⌊s / L⌋: the whole rounds of L merges a Δ that is `staleness` merges old missed."""
  if staleness < 0 or num_learners < 1:
    raise ValueError(f"staleness must be >= 0 and num_learners >= 1, got {staleness}, "
                     f"{num_learners}")
  return staleness // num_learners


def weight(rule: str, rounds: int, max_staleness: int = 0) -> float:
  """The factor of a Δ that is `rounds` rounds behind under `rule` (0: dropped)."""
  if rounds < 0:
    raise ValueError(f"rounds behind must be >= 0, got {rounds}")
  if rule in ("inverse", "heloco"):
    return 1.0 / (1.0 + rounds)
  if rule == "cutoff":
    return 1.0 if rounds <= max_staleness else 0.0
  if rule == "none":
    return 1.0
  raise ValueError(f"elastic.staleness must be one of {', '.join(STALENESS_RULES)}, got {rule!r}")
