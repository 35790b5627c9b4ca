"""Faults as configuration: what `elastic.faults` and `elastic.faults_per_hour` inject, and when.

`elastic.faults` lists faults that fire at a learner's inner step (or a syncer round), each once per
run, comma-separated:

  kill:learner=I:step=S               learner I dies (its process exits) after step S
  stop:learner=I:step=S:seconds=D     learner I is stopped (SIGSTOP) for D seconds after step S
  slow:learner=I:step=S:factor=F      learner I runs F times slower from step S on
  kill_syncer:round=R                 the syncer dies when round R of fragment 0 has its quorum,
                                      before closing it

`elastic.faults_per_hour` adds kills of random learners from outside (`ray.kill`) at Poisson times
(`poisson_kills`), the benchmark's fault schedule.

"Once per run" survives restarts: firing creates a marker file in the run's `faults/` folder
(`fire_once`), so a learner restarted after its kill does not kill itself again.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np

KINDS = {"kill": ("learner", "step"), "stop": ("learner", "step", "seconds"),
         "slow": ("learner", "step", "factor"), "kill_syncer": ("round",)}
_SYNTAX = ("kill:learner=I:step=S, stop:learner=I:step=S:seconds=D, slow:learner=I:step=S:factor=F "
           "or kill_syncer:round=R, comma-separated")


@dataclasses.dataclass(frozen=True)
class Fault:
  kind: str
  learner: int = -1
  step: int = 0
  seconds: float = 0.0
  factor: float = 1.0
  round: int = 0

  @property
  def name(self) -> str:
    """A name unique within a run (the marker file's)."""
    if self.kind == "kill_syncer":
      return f"kill_syncer-round{self.round}"
    return f"{self.kind}-learner{self.learner}-step{self.step}"


def parse(spec: str, num_learners: int) -> tuple[Fault, ...]:
  """The faults of an `elastic.faults` string; one ValueError line naming the option otherwise."""
  faults = []
  for item in (s.strip() for s in spec.split(",") if s.strip()):
    kind, *fields = item.split(":")
    if kind not in KINDS:
      raise ValueError(f"elastic.faults: unknown fault kind {kind!r} in {item!r}; "
                       f"allowed: {_SYNTAX}")
    values = {}
    for field in fields:
      key, _, value = field.partition("=")
      if key not in KINDS[kind] or not value:
        raise ValueError(f"elastic.faults: {item!r} has {field!r}; {kind} takes "
                         f"{', '.join(k + '=' for k in KINDS[kind])} ({_SYNTAX})")
      try:
        values[key] = float(value) if key in ("seconds", "factor") else int(value)
      except ValueError:
        raise ValueError(f"elastic.faults: {item!r}: {key} must be a number, "
                         f"got {value!r}") from None
    missing = [k for k in KINDS[kind] if k not in values]
    if missing:
      raise ValueError(f"elastic.faults: {item!r} lacks {', '.join(missing)} ({_SYNTAX})")
    fault = Fault(kind, **values)
    if kind != "kill_syncer" and not 0 <= fault.learner < num_learners:
      raise ValueError(f"elastic.faults: {item!r}: learner must be in [0, {num_learners}) "
                       f"(elastic.num_learners={num_learners})")
    if fault.step < 0 or fault.round < 0 or fault.seconds < 0 or fault.factor < 1:
      raise ValueError(f"elastic.faults: {item!r}: step and round must be >= 0, seconds >= 0 and "
                       "factor >= 1")
    faults.append(fault)
  names = [f.name for f in faults]
  if len(set(names)) != len(names):
    raise ValueError(f"elastic.faults lists a fault twice: {spec!r}")
  return tuple(faults)


def fire_once(run_dir: pathlib.Path, fault: Fault) -> bool:
  """True the first time `fault` fires in this run (a marker file is created atomically)."""
  folder = pathlib.Path(run_dir) / "faults"
  folder.mkdir(parents=True, exist_ok=True)
  try:
    os.close(os.open(folder / fault.name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
  except FileExistsError:
    return False
  return True


def fired(run_dir: pathlib.Path) -> list[str]:
  """The names of the faults fired so far in this run."""
  folder = pathlib.Path(run_dir) / "faults"
  return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def poisson_kills(faults_per_hour: float, duration_s: float, num_learners: int,
                  seed: int) -> list[tuple[float, int]]:
  """(seconds after the start, learner) of the kills of a Poisson process of rate
  `faults_per_hour` over `duration_s`, each at a uniformly drawn learner."""
  if faults_per_hour <= 0:
    return []
  rng = np.random.default_rng(seed)
  kills, t = [], 0.0
  while True:
    t += rng.exponential(3600.0 / faults_per_hour)
    if t >= duration_s:
      return kills
    kills.append((t, int(rng.integers(num_learners))))
