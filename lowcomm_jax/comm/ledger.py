"""The communication ledger: every cross-replica collective records its payload at trace time.

Bytes come from shapes, dtypes and the codec, never from measuring, so the
figures are exact: a run reports the bytes each worker sends in total, at the
peak of one sync, and per parameter per step. A `Ledger` collects the entries
made while it is active (`with ledger.recording(): jax.jit(f).lower(...)`);
the Trainer records each compiled program once and adds its entries for every
step that runs it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

_ACTIVE: contextvars.ContextVar["Ledger | None"] = contextvars.ContextVar("ledger", default=None)
_PLAN: contextvars.ContextVar["str | None"] = contextvars.ContextVar("ledger_plan", default=None)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One collective, as traced.

  Attributes:
    name: what was moved (e.g. "fragment 0").
    kind: "all_reduce", "ppermute", "all_to_all", "all_gather".
    payload_bytes: encoded bytes of one worker's operand (codes + scales).
    sent_bytes: bytes one worker puts on the wire for it (payload × the algorithm's factor).
    num_workers: size of the replica group.
    repeats: how many times one run of the program issues it (the pipeline's ticks that share one
      transfer pattern trace one permute); `sent_bytes` already counts them.
    plan: the name of the algorithm's `comm.Plan` it carries (`comm.dispatch.carry`), or None for
      the gradient source's own transfers (the pipeline's stage-to-stage permutes).
  """

  name: str
  kind: str
  payload_bytes: int
  sent_bytes: float
  num_workers: int
  repeats: int = 1
  plan: str | None = None


class Ledger:
  """A list of `Entry`s; the active ledger (if any) receives every `record` call."""

  def __init__(self):
    self.entries: list[Entry] = []

  @contextlib.contextmanager
  def recording(self):
    token = _ACTIVE.set(self)
    try:
      yield self
    finally:
      _ACTIVE.reset(token)

  @property
  def sent_bytes(self) -> float:
    return sum(e.sent_bytes for e in self.entries)


@contextlib.contextmanager
def carrying(plan_name: str):
  """Entries recorded inside belong to the plan `plan_name` (`Entry.plan`)."""
  token = _PLAN.set(plan_name)
  try:
    yield
  finally:
    _PLAN.reset(token)


def ring_factor(num_workers: int) -> float:
  """Bytes a worker sends in a ring all-reduce per byte of payload: 2(M−1)/M (0 for M = 1)."""
  return 2 * (num_workers - 1) / num_workers


def record(name: str, kind: str, payload_bytes: int, sent_bytes: float, num_workers: int,
           repeats: int = 1, plan: str | None = None) -> None:
  """Adds an entry to the active ledger (to the plan being carried, if any); a no-op when none is
  active."""
  ledger = _ACTIVE.get()
  if ledger is not None:
    ledger.entries.append(Entry(name, kind, int(payload_bytes), float(sent_bytes), int(num_workers),
                                int(repeats), plan if plan is not None else _PLAN.get()))


def add(entries) -> None:
  """Adds `Entry`s recorded elsewhere (one traced branch of several alike) to the active ledger."""
  for e in entries:
    record(e.name, e.kind, e.payload_bytes, e.sent_bytes, e.num_workers, e.repeats, e.plan)
