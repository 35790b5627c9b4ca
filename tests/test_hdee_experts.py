"""HDEE experts trained for real (tiny model, a few steps): chaining, ensembles, compute, errors.

One module fixture runs the whole experiment once on three one-domain chains
(two portable domains and the small KJV Bible) and a held-out domain; the
tests read its runs. A persistent compilation cache (the session's from
conftest.py, else one in the fixture's folder) lets runs of the same size and
step count compile their programs once.
"""

import json

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from lowcomm_jax import testing
from lowcomm_jax.data import debian
from lowcomm_jax.hdee import ensemble, experiment, experts, plan, scoring

_CHAINS = {"hard": ("stdlib",), "moderate": ("licenses",), "easy": ("bible_kjv",)}
_EVAL_DOMAINS = ("stdlib", "licenses", "bible_kjv", "fortunes")
_STEPS = 4
# Licence texts are a held-out domain: a chain may train on one here (portable text, no fetch),
# but the seed mix refuses it, so the seed reads the two training domains.
# Equal seed and expert learning rates and no warm-up make a seed of 4 steps and an M
# expert of 4 steps the same program, so the compilation cache serves both.
_SETUP = experts.ExpertSetup(model_size="tiny", seq_len=32, batch_size=8, seed_steps=_STEPS,
                             seed_learning_rate=3e-3, domain_learning_rate=3e-3,
                             domain_warmup_steps=0, seed_domains=("bible_kjv", "stdlib"))


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  previous = jax.config.values["jax_compilation_cache_dir"]
  previous_min = jax.config.values["jax_persistent_cache_min_compile_time_secs"]
  previous_optimizations = jax.config.values["jax_disable_most_optimizations"]
  # Tiny models run a few steps: XLA's optimization passes would cost more than they save.
  jax.config.update("jax_disable_most_optimizations", True)
  if not previous:  # conftest.py normally sets a session-wide cache; otherwise use our own
    compilation_cache.set_cache_dir(str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  compilation_cache.reset_cache()  # re-read the settings at the next compile
  yield
  jax.config.update("jax_compilation_cache_dir", previous)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", previous_min)
  jax.config.update("jax_disable_most_optimizations", previous_optimizations)
  compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, compile_cache):
  del compile_cache
  try:
    debian.ensure_fetched(["bible_kjv", "fortunes"])
  except debian.FetchError as error:
    pytest.skip(f"Debian corpora cannot be fetched here: {error}")
  root = tmp_path_factory.mktemp("hdee")
  results = experiment.run_experiment(root, _SETUP, _STEPS, _CHAINS, _EVAL_DOMAINS,
                                      validation_sequences=4, test_sequences=4,
                                      log=lambda message: None)
  return root, results


def _plans():
  return experts.make_plans(_SETUP, _STEPS, _CHAINS)


def test_compute_spent_per_setting_is_equal(trained):
  root, results = trained
  spent = {s: info["spent_flops"] for s, info in results["settings"].items()}
  # Tiny plan: hard/moderate/easy = 5/4/3 steps of M, or 4 steps of L/M/S, against 4/4/4 of M;
  # the FLOPs formula is linear in d_ff and S/L are 0.75x/1.25x M's width, so the sums agree.
  # Integer-valued float64 products and sums far below 2^53: exact in any order.
  for setting, flops in spent.items():
    assert flops == spent["homogeneous"], setting
  tokens_per_step = _SETUP.tokens_per_step
  expected = 3 * _STEPS * tokens_per_step * _SETUP.flops_per_token("M")
  assert spent["homogeneous"] == expected
  # And it is what the runs really trained: the tokens in each run's summary.
  hard = _plans()["heterogeneous_steps"].chain("hard")
  summary = json.loads((experts.chain_workdirs(root, hard)[0] / "summary.json").read_text())
  assert summary["steps"] == 5 and summary["tokens"] == 5 * tokens_per_step
  assert results["settings"]["heterogeneous_sizes"]["chains"]["hard"]["size"] == "L"


def test_table_covers_every_domain_setting_and_method(trained):
  root, results = trained
  assert list(results["domains"]) == list(_EVAL_DOMAINS)
  assert results["domains"]["fortunes"]["role"] == "held out"
  for row in results["domains"].values():
    for setting in plan.SETTINGS:
      for method in ("uniform_prior", "cached_prior", "best_expert"):
        assert 1.0 < row[setting][method] < 256.0  # a byte model beats uniform bytes
    assert row["heterogeneous_sizes"]["parameter_average"] is None  # S/M/L cannot be averaged
    assert row["homogeneous"]["parameter_average"] > 1.0
  assert sum(results["wins"].values()) == len(_EVAL_DOMAINS)
  for name in ("results.md", "results.json", "results.png"):
    assert (root / name).stat().st_size > 0


def test_second_iteration_starts_from_the_first_ones_final_parameters(trained):
  root, _ = trained
  chain = plan.ChainPlan("hard", ("stdlib", "licenses"), "M", (_STEPS, _STEPS),
                         _SETUP.flops_per_token("M"), _SETUP.tokens_per_step)
  first, second = experts.train_chain(_SETUP, chain, root, ["stdlib", "licenses"])
  from lowcomm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  second_trainer = trainer_lib.Trainer(config_lib.load_run_config(second), second)
  initial = second_trainer.init_params()
  final_first = scoring.load_expert(first).params
  jax.tree.map(np.testing.assert_array_equal, initial, final_first)
  # The second run then trained: its final parameters moved away from that start.
  final_second = scoring.load_expert(second).params
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                       final_second, final_first)
  assert max(jax.tree.leaves(moved)) > 0
  # The first iteration itself started from the seed of its size.
  first_config = json.loads((first / "config.json").read_text())["config"]
  assert first_config["init_from"] == str(experts.seed_workdir(root, "M"))


def test_ensemble_of_identical_trained_experts_equals_the_expert(trained):
  root, _ = trained
  hard = _plans()["homogeneous"].chain("hard")
  expert = scoring.load_expert(experts.chain_workdirs(root, hard)[-1])
  windows = scoring.domain_windows("bible_kjv", "test", _SETUP.seq_len, 4)
  single_BxT = scoring.token_log_probs(expert, windows)
  assert single_BxT.shape == (4, _SETUP.seq_len) and np.all(single_BxT <= 0)
  copies_ExBxT = np.stack([single_BxT] * 3)
  # Σ_e w_e p = p for any normalized w: only the two passes' own roundings count (log_softmax over
  # E = 3, logsumexp of log w + log p), magnitudes ≤ |log p| + |log 0.1| + log 3 + 1
  mixture_bound = testing.logsumexp_error_bound(np.abs(single_BxT) + 2.31 + np.log(3) + 1, 3, 2)
  testing.assert_within(ensemble.ensemble_log_probs(copies_ExBxT), single_BxT, mixture_bound,
                        "uniform prior")
  skewed_prior = np.log(np.array([0.7, 0.2, 0.1], np.float32))
  testing.assert_within(ensemble.ensemble_log_probs(copies_ExBxT, skewed_prior), single_BxT,
                        mixture_bound, "skewed prior")
  scores = ensemble.evaluate_domain(copies_ExBxT, copies_ExBxT)
  expected = float(ensemble.perplexity(single_BxT))
  # log-probs within mixture_bound (the simple average: (x + x + x) / 3, 2 roundings of |x|)
  log_prob_error = np.maximum(mixture_bound, testing.operation_error_bound(np.abs(single_BxT), 2))
  for method in ("uniform_prior", "cached_prior", "simple_average", "best_expert"):
    testing.assert_within(scores[method], expected, testing.perplexity_error_bound(
        expected, single_BxT, log_prob_error), method)
  # The parameter average of identical experts is the expert itself: (p + p + p) / 3 rounds ≤ 2
  # times per parameter, a relative change of every product no larger than the forward's own
  # rounding over its chain of sums (one token's log-softmax over V), so two such forwards' bound.
  averaged = scoring.average_parameters([expert] * 3)
  testing.assert_within(scoring.token_log_probs(averaged, windows), single_BxT,
                        testing.sum_error_bound(
      np.abs(single_BxT).max(), testing.tiny_chain_of_sums(_SETUP.seq_len, 1)), "parameter average")


def test_rerun_skips_finished_runs_and_gives_the_same_table(trained):
  root, results = trained
  seed = experts.seed_workdir(root, "M") / "summary.json"
  before = seed.stat().st_mtime_ns
  again = experiment.run_experiment(root, _SETUP, _STEPS, _CHAINS, _EVAL_DOMAINS,
                                    validation_sequences=4, test_sequences=4,
                                    log=lambda message: None)
  assert seed.stat().st_mtime_ns == before
  assert again["domains"] == json.loads(json.dumps(results["domains"]))
  assert again["wins"] == results["wins"]


def test_bad_input_gives_one_clear_error(trained, tmp_path):
  root, _ = trained
  with pytest.raises(ValueError, match="unknown HDEE domain 'klingon'; allowed: stdlib"):
    experts.make_plans(_SETUP, _STEPS, {**_CHAINS, "easy": ("klingon",)})
  with pytest.raises(ValueError, match="unknown HDEE domain 'klingon'"):
    experiment.run_experiment(tmp_path, _SETUP, _STEPS, _CHAINS, ["klingon"])
  assert not any(tmp_path.iterdir())  # refused before anything was trained or written
  with pytest.raises(ValueError, match="steps_per_domain must be a positive multiple of 4"):
    experts.make_plans(_SETUP, 2, _CHAINS)
  with pytest.raises(ValueError, match="budget_flops=.* is too small"):
    plan.make_plans(1.0, _SETUP.flops_per_token, _SETUP.tokens_per_step, _CHAINS)
  with pytest.raises(ValueError, match="model.size must be one of"):
    experts.ExpertSetup(model_size="huge")
  with pytest.raises(ValueError, match="may not read held-out domain 'fortunes'"):
    experts.seed_corpus_name(["fortunes"])
  with pytest.raises(ValueError, match="no finished run"):
    scoring.load_expert(tmp_path)
  # A finished run's workdir refuses a different config instead of passing its summary off.
  config = experts.run_config(_SETUP, "M", "domain:stdlib", 8, 1e-3, 0)
  with pytest.raises(ValueError, match="holds a run of another config"):
    experts.train_run(config, experts.seed_workdir(root, "M"))
