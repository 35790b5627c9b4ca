"""Elastic learners on Ray: DiLoCo, Streaming DiLoCo and SparseLoCo that keep training while
learners fail, straggle, leave and join.

`run(config, workdir)` (experiments/elastic.py) starts a syncer and `elastic.num_learners` learners
as Ray actors and returns the summary (docs/elastic.md); `start(config, workdir)` returns the run
going on, to add and remove learners (`add_learner`, `remove_learner`) before `wait()`. The
submodules: `options` (the derived configs and checks), `grace` (the grace window), `syncer`,
`learner` and `driver`; the faults it injects are `train.faults`.
"""


def run(config, workdir) -> dict:
  """Trains as `config` says with elastic learners; returns summary.json's content."""
  from lowcomm_jax.elastic.driver import run as run_elastic  # pylint: disable=g-import-not-at-top
  return run_elastic(config, workdir)


def start(config, workdir):
  """Starts the run and returns it going on (`driver.ElasticRun`): `add_learner()`,
  `remove_learner(i)`, `status()`, then `wait()` for the summary."""
  from lowcomm_jax.elastic.driver import start as start_elastic  # pylint: disable=g-import-not-at-top
  return start_elastic(config, workdir)
