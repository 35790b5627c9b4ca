"""benchmarks/elastic.py's pure parts: a learner's timeline intervals and the rounds' last-arrival
waits, from synthetic events."""

import importlib.util
import pathlib

import pytest

PATH = pathlib.Path(__file__).parent.parent / "benchmarks" / "elastic.py"


@pytest.fixture(scope="module")
def bench():
  spec = importlib.util.spec_from_file_location("elastic_benchmark", PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _ev(t, event, **fields):
  return {"time": t, "event": event, **fields}


def test_intervals_of_a_learner_that_dies_and_heals(bench):
  events = [_ev(0, "start"), _ev(1, "ready"), _ev(1.5, "run"), _ev(3, "joined", step=0),
            _ev(5, "sync_begin", step=10, fragment=0), _ev(6, "sync_end", step=10, fragment=0),
            # killed at 8 (the driver notices at 8.5), restarted at 12, joined at 15
            _ev(12, "start"), _ev(13, "ready"), _ev(13.2, "run"), _ev(15, "joined", step=20),
            _ev(17, "sync_begin", step=30, fragment=0), _ev(18, "sync_end", step=30, fragment=0),
            _ev(20, "finished", step=40)]
  got = bench.intervals(events, deaths=[8.0], end=25.0)
  assert got == [("starting", 0, 3), ("training", 3, 5), ("syncing", 5, 6), ("training", 6, 8.0),
                 ("dead", 8.0, 12), ("healing", 12, 15), ("training", 15, 17),
                 ("syncing", 17, 18), ("training", 18, 20)]


def test_a_kill_event_starts_the_dead_interval_and_the_drivers_later_death_does_not(bench):
  events = [_ev(0, "start"), _ev(2, "joined", step=0), _ev(4, "kill", step=7),
            _ev(9, "start"), _ev(11, "joined", step=10)]
  got = bench.intervals(events, deaths=[4.6], end=14.0)
  assert got == [("starting", 0, 2), ("training", 2, 4), ("dead", 4, 9), ("healing", 9, 11),
                 ("training", 11, 14.0)]


def test_last_arrival_waits_take_the_latest_sync_begin_of_each_round(bench):
  a = [_ev(10, "sync_begin", step=10, fragment=0), _ev(13, "sync_end", step=10, fragment=0),
       _ev(20, "sync_begin", step=20, fragment=0), _ev(20.5, "sync_end", step=20, fragment=0)]
  b = [_ev(12, "sync_begin", step=10, fragment=0), _ev(13.25, "sync_end", step=10, fragment=0),
       _ev(19, "sync_begin", step=20, fragment=0), _ev(20.5, "sync_end", step=20, fragment=0)]
  # round 10: b came last and waited 1.25 s; round 20: a came last and waited 0.5 s
  assert bench.last_arrival_waits([a, b]) == [1.25, 0.5]


def test_rejoin_phases_split_death_to_joined(bench):
  events = [_ev(0, "start"), _ev(2, "joined", step=0),
            _ev(10.5, "start"), _ev(12, "ready"), _ev(12.25, "run"), _ev(15, "joined", step=30)]
  got = bench.rejoin_phases(events, 9.0)
  assert got == {"restart": 1.5, "construct": 1.5, "called": 0.25, "heal": 2.75,
                 "from_last_event": 13.0}
  assert sum(got[k] for k in ("restart", "construct", "called", "heal")) == 15 - 9.0
  assert bench.rejoin_phases(events[:2], 9.0) is None


def test_a_death_the_driver_sees_after_the_restart_does_not_kill_the_healing_learner(bench):
  events = [_ev(0, "start"), _ev(2, "joined", step=0), _ev(9, "start"), _ev(11, "joined", step=50)]
  got = bench.intervals(events, deaths=[9.5], end=14.0)
  assert got == [("starting", 0, 2), ("training", 2, 9), ("healing", 9, 11), ("training", 11, 14.0)]


def test_rejoin_phases_when_the_driver_saw_the_death_after_the_restart(bench):
  events = [_ev(0, "start"), _ev(2, "joined", step=0), _ev(7, "sync_end", step=10, fragment=0),
            _ev(9, "start"), _ev(10, "ready"), _ev(10.5, "run"), _ev(12, "joined", step=20)]
  got = bench.rejoin_phases(events, 9.5)
  assert got == {"restart": -0.5, "construct": 1.0, "called": 0.5, "heal": 1.5,
                 "from_last_event": 5.0}


def test_sync_waits_pair_each_begin_with_its_end(bench):
  events = [_ev(0, "joined", step=0), _ev(2, "sync_begin", step=10, fragment=0),
            _ev(2.5, "sync_end", step=10, fragment=0), _ev(4, "sync_begin", step=20, fragment=0),
            _ev(4.25, "start"),  # killed while waiting: no end for that begin
            _ev(7, "sync_begin", step=30, fragment=0), _ev(8, "sync_end", step=30, fragment=0)]
  assert bench.sync_waits(events) == [0.5, 1.0]
