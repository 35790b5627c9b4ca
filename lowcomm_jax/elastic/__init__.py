"""Elastic learners on Ray: DiLoCo that keeps training while learners fail, straggle, leave and join.

`run(config, workdir)` (experiments/elastic.py) starts a syncer and `elastic.num_learners` learners
as Ray actors (docs/elastic.md). The submodules: `options` (the derived configs and checks),
`faults` (fault injection), `syncer`, `learner` and `driver`.
"""


def run(config, workdir) -> dict:
  """Trains as `config` says with elastic learners; returns summary.json's content."""
  from lowcomm_jax.elastic.driver import run as run_elastic  # pylint: disable=g-import-not-at-top
  return run_elastic(config, workdir)
