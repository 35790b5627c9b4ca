"""Faults as configuration (`train.faults`): the `elastic.faults` specs and the Poisson kills'
schedule, as the driver is handed it (no Ray: the elastic runs that fire them are
tests/test_elastic.py)."""

import numpy as np

from lowcomm_jax.train import faults as faults_lib


def test_fault_specs_and_poisson_schedule():
  parsed = faults_lib.parse("kill:learner=1:step=25, stop:learner=0:step=3:seconds=2.5,"
                            "slow:learner=1:step=1:factor=3,kill_syncer:round=2", 2)
  assert [f.kind for f in parsed] == ["kill", "stop", "slow", "kill_syncer"]
  assert parsed[1].seconds == 2.5 and parsed[2].factor == 3.0 and parsed[3].round == 2
  kills = faults_lib.poisson_kills(3600.0, 2000.0, 4, seed=0)  # rate 1/s over 2,000 s
  assert abs(len(kills) - 2000) < 4 * np.sqrt(2000)  # Poisson: mean 2,000, sd 45
  assert sorted({i for _, i in kills}) == [0, 1, 2, 3]
  assert all(a < b for (a, _), (b, _) in zip(kills, kills[1:]))


def test_poisson_kills_hand_over_the_due_kills_of_live_learners_once(tmp_path):
  """The driver's hook: at each poll, the kills whose time has come, of learners still running
  (learner indices as the run numbers them), each recorded once under a name of its own."""
  schedule = faults_lib.poisson_kills(3600.0, 20.0, 3, seed=1)  # about one a second for 20 s
  kills = faults_lib.PoissonKills(tmp_path, 3600.0, 20.0, [4, 7, 9], seed=1)
  assert [v for _, v in kills.kills] == [[4, 7, 9][i] for _, i in schedule]
  middle = schedule[len(schedule) // 2][0]
  first = kills.due(middle, alive={4, 7, 9})
  assert first == [[4, 7, 9][i] for t, i in schedule if t <= middle]
  assert kills.due(middle, alive={4, 7, 9}) == []  # handed over once
  rest = kills.due(20.0, alive={7})  # 4 and 9 ended meanwhile: their later kills are void
  assert rest == [7] * sum(1 for t, i in schedule if t > middle and i == 1)
  assert len(faults_lib.fired(tmp_path)) == len(first) + len(rest) == kills.fired
