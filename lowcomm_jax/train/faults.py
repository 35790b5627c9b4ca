"""Faults as configuration: what `elastic.faults` and `elastic.faults_per_hour` inject, and when;
`StepFaults`, the hook that fires a learner's faults in its training loop.

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
(`fire_once`), so a learner restarted after its kill does not kill itself again. Each fault fires
from a hook, none from the code it interrupts: a learner's from `StepFaults`, a hook of its loop
(`train.hooks`); the syncer's from `SyncerFaults`, called when a round has its quorum
(`elastic.syncer`); the Poisson kills from `PoissonKills`, which the driver asks for the kills due
as it polls its learners (`elastic.driver`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import subprocess
import time

import numpy as np

from lowcomm_jax.train import hooks

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


def speeds(spec: str, num_learners: int) -> tuple[float, ...]:
  """The learners' relative speeds of an `elastic.speeds` string ("" : all 1); one ValueError line
  naming the option otherwise. Speed s_i makes learner i's steps max(s)/s_i times as long as its
  own (a `slow` fault from step 0 with that factor)."""
  if not spec.strip():
    return (1.0,) * num_learners
  items = [s.strip() for s in spec.split(",")]
  try:
    values = tuple(float(s) for s in items)
  except ValueError:
    values = ()
  if len(values) != num_learners or not all(math.isfinite(v) and v > 0 for v in values):
    raise ValueError(f"elastic.speeds must be {num_learners} numbers > 0, comma-separated (one "
                     f"per learner, elastic.num_learners={num_learners}), got {spec!r}")
  return values


def slowdowns(spec: str, num_learners: int) -> tuple[float, ...]:
  """Per learner, the factor its steps are slowed by: the fastest speed over its own (>= 1)."""
  values = speeds(spec, num_learners)
  return tuple(max(values) / v for v in values)


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


class StepFaults(hooks.Hook):
  """Fires learner `learner`'s faults of `faults` after its steps (`elastic.faults`: kill, stop,
  slow), each once per run; `event(kind, **fields)` records one as it fires. `slowdown` (>= 1, from
  `slowdowns`) slows every step from the first on, as a slow fault at step 0."""

  def __init__(self, run_dir, faults, learner: int, event, slowdown: float = 1.0):
    self.run_dir, self.learner, self.event = pathlib.Path(run_dir), learner, event
    self.faults = [f for f in faults if f.kind != "kill_syncer" and f.learner == learner]
    # F times this learner's usual step time: its speed (`elastic.speeds`) from the start, a slow
    # fault's factor from its step on
    self.slow = float(slowdown)
    self._seen = set()  # this start's faults already looked at
    self._step_times, self._began, self._first = [], None, None

  def begin(self, loop) -> None:
    self._first = loop.start + 1  # the first step of a start compiles: not timed
    self._began = time.perf_counter()

  def after_step(self, step, phase, state, metrics):
    now = time.perf_counter()
    if step > self._first:
      self._step_times.append(now - self._began)
    for fault in self.faults:  # at step S, or the first step after it (a catch-up skips steps)
      if step < fault.step or fault in self._seen:
        continue
      self._seen.add(fault)  # looked at once per start: no marker file to test every step
      if fault.kind == "slow":
        self.slow = max(self.slow, fault.factor)  # from this step on, for the rest of the run
        fire_once(self.run_dir, fault)
      elif fire_once(self.run_dir, fault):
        self.event(fault.kind, step=step, seconds=fault.seconds)
        if fault.kind == "kill":
          os._exit(1)  # pylint: disable=protected-access
        stop_for(fault.seconds)
    if self.slow > 1 and self._step_times:
      time.sleep((self.slow - 1) * float(np.median(self._step_times[-20:])))
    self._began = time.perf_counter()
    return state


class SyncerFaults:
  """Fires the `kill_syncer:round=R` faults of `faults`: the syncer's process dies once round R of
  fragment 0 has its quorum, before closing it (once per run: a restarted syncer fills the round
  again and closes it)."""

  def __init__(self, run_dir, faults):
    self.run_dir = pathlib.Path(run_dir)
    self.faults = [f for f in faults if f.kind == "kill_syncer"]

  def quorum(self, fragment: int, round_: int) -> None:
    """Round `round_` of plan `fragment` has its quorum (the syncer calls this before closing)."""
    for fault in self.faults:
      if fragment == 0 and round_ == fault.round and fire_once(self.run_dir, fault):
        os._exit(1)  # pylint: disable=protected-access


class PoissonKills:
  """`elastic.faults_per_hour`'s kills (`poisson_kills` over `duration_s`, of `learners`: the run's
  learner indices at its start). `due(elapsed_s)` hands over the learners whose kill time has come
  and records each in the run's `faults/` folder as a kill fault (its step: −1 for the first kill,
  −2 for the next, ...; a kill from outside has no step)."""

  def __init__(self, run_dir, faults_per_hour: float, duration_s: float, learners: list[int],
               seed: int):
    self.run_dir = pathlib.Path(run_dir)
    learners = sorted(learners)
    self.kills = [(t, learners[i])
                  for t, i in poisson_kills(faults_per_hour, duration_s, len(learners), seed)]
    self.fired = 0

  def due(self, elapsed_s: float, alive) -> list[int]:
    """The learners to kill now (of those due, the ones in `alive`), each recorded as fired."""
    victims = []
    while self.kills and elapsed_s >= self.kills[0][0]:
      _, victim = self.kills.pop(0)
      if victim in alive:
        self.fired += 1
        fire_once(self.run_dir, Fault("kill", learner=victim, step=-self.fired))
        victims.append(victim)
    return victims


def stop_for(seconds: float) -> None:
  """Stops this process (SIGSTOP) for `seconds`, from another process that wakes it (SIGCONT).

  That process looks every 0.1 s and ends at once when something else woke or ended this one
  first, so it never outlives the stop nor signals a process id that was used again.
  """
  pid, ticks = os.getpid(), max(1, math.ceil(seconds * 10))
  subprocess.Popen(["sh", "-c", f"kill -STOP {pid}; i=0; while [ $i -lt {ticks} ]; do "
                    f"sleep 0.1; i=$((i+1)); grep -q '^State:.*stopped' /proc/{pid}/status "
                    f"2>/dev/null || exit 0; done; kill -CONT {pid}"], start_new_session=True)
  time.sleep(0.05)
