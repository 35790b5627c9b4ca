"""The elastic runs the benchmarks share (benchmarks/elastic.py, benchmarks/async_learners.py): a
config of experiments/configs/elastic.py with their changes, and a run with every learner's
events."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def config(steps: int, learners: int, faults_per_hour: float, timeout_s: float,
            variant: str = "tiny", **changes):
  from lowcomm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      "elastic_config", ROOT / "experiments" / "configs" / "elastic.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(variant)
  return config_lib.override(c, {
      "num_steps": steps, "eval.every": steps, "progress_bar": False,
      "elastic.num_learners": learners, "num_replicas": learners,
      "elastic.faults_per_hour": faults_per_hour, "elastic.timeout_s": timeout_s, **changes})


def run(config, work: pathlib.Path) -> dict:
  from lowcomm_jax import elastic  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.elastic import driver  # pylint: disable=g-import-not-at-top
  summary = elastic.run(config, work)
  n = summary["learners"]
  summary["events"] = [driver.events(work, i) for i in range(n)]
  return summary
