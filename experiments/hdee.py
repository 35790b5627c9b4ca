"""HDEE at equal compute: three ensembles of domain-expert chains, one per-domain perplexity table.

  python experiments/hdee.py --workdir=runs/hdee            # small-derived S/M/L, about an hour
  python experiments/hdee.py --workdir=/tmp/hdee_quick --quick   # tiny model, a smoke run

Plans the three settings (homogeneous M_Ho-I_Ho, heterogeneous steps
M_Ho-I_He, heterogeneous sizes M_He-I_Ho) at the FLOPs of
`--steps_per_domain` homogeneous steps, trains seed models and expert chains
(one Trainer run per workdir; finished runs are skipped, so rerunning resumes),
scores every domain's test split and writes results.md, results.json and
results.png into the workdir. See docs/data_and_hdee.md for the results.

It reads the Debian-packaged domains from the corpora cache and never downloads
them: when some are missing it stops at once, before writing anything, with the
command that fetches them (experiments/fetch_corpora.py, about 10 s).
"""

import sys

from absl import flags, logging

from lowcomm_jax import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Folder of all runs and results.", required=True)
_STEPS = flags.DEFINE_integer("steps_per_domain", 100,
                              "Homogeneous steps per domain (multiple of 4); sets the budget.")
_SEED_STEPS = flags.DEFINE_integer("seed_steps", 300, "Steps of each seed model (S, M, L).")
_MODEL = flags.DEFINE_string("model", "small", "Model preset the S/M/L experts derive from.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Sequences per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Bytes per sequence.")
_VALIDATION = flags.DEFINE_integer("validation_sequences", 32,
                                   "Validation windows per domain (cached prior, best expert).")
_TEST = flags.DEFINE_integer("test_sequences", 64, "Test windows per domain that are scored.")
_SEED = flags.DEFINE_integer("seed", 0, "Parameter init and data order of every run.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny model and a few steps: a smoke run of a minute "
                           "or two (overrides the sizes and steps above).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from lowcomm_jax.data import debian, domains  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.hdee import experiment, experts  # pylint: disable=g-import-not-at-top
  missing = [d.corpus.split(":", 1)[1] for d in domains.DOMAINS.values()
             if d.needs_fetch and not debian.is_fetched(d.corpus.split(":", 1)[1])]
  if missing:  # fetching (apt) is fetch_corpora.py's job, never this run's
    sys.exit(f"HDEE reads {len(missing)} Debian corpora that are not "
             f"in {debian.default_cache_dir()}: {', '.join(missing)}; fetch them first with:\n  "
             + debian.FETCH_COMMAND.format(names=",".join(missing)))
  experts.enable_compilation_cache(f"{_WORKDIR.value}/jax_cache")

  if _QUICK.value:
    setup = experts.ExpertSetup(model_size="tiny", seq_len=64, batch_size=8, seed_steps=8,
                                seed=_SEED.value)
    steps, validation, test = 4, 4, 8
  else:
    setup = experts.ExpertSetup(model_size=_MODEL.value, seq_len=_SEQ_LEN.value,
                                batch_size=_BATCH.value, seed_steps=_SEED_STEPS.value,
                                seed=_SEED.value)
    steps, validation, test = _STEPS.value, _VALIDATION.value, _TEST.value
  results = experiment.run_experiment(_WORKDIR.value, setup, steps,
                                      validation_sequences=validation, test_sequences=test)
  print(experiment.format_results(results))


if __name__ == "__main__":
  cli.run(main)
