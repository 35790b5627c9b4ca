"""Loss (nats per token) and bits per byte of a run's latest checkpoint, on its own eval data or
on any other configured data.

  python experiments/evaluate.py --workdir=runs/diloco
  python experiments/evaluate.py --workdir=runs/diloco --config.data.corpus=licenses \
      --config.eval.num_batches=32
  python experiments/evaluate.py --workdir=runs/hdee/<expert run> \
      --corpora=domain:austen,domain:gcide,domain:stdlib      # one line per domain

Changeable: data.corpus, data.eval_permille, data.seq_len, data.doc_separator, data.doc_chars,
eval.batch_size, eval.num_batches (the tokenizer and the model are the run's). Prints one JSON
line per corpus; the workdir is only read. An HDEE expert is one run: --corpora scores it per
domain; the ensembles' per-domain table is experiments/hdee.py's.
"""

import json
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "A run directory with a checkpoint.", required=True)
_CORPORA = flags.DEFINE_list("corpora", [],
                             "data.corpus values to evaluate on, one after the other "
                             "(default: the run's, or --config.data.corpus).")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  changes = {}
  for arg in argv[1:]:
    key, eq, value = arg.removeprefix("--config.").partition("=")
    if not arg.startswith("--config.") or not eq:
      sys.exit(f"ValueError: unknown argument {arg!r}; give --config.<key>=<value>")
    changes[key] = value
  from lowcomm_jax.train import evaluation  # pylint: disable=g-import-not-at-top
  try:
    results = evaluation.evaluate_corpora(_WORKDIR.value, _CORPORA.value, changes)
  except ValueError as error:
    sys.exit(f"ValueError: {error}")
  for result in results:
    print(json.dumps(result))


if __name__ == "__main__":
  # --config.<key>=<value> arguments are the run config's, not absl flags: passed on in argv.
  config_args = [a for a in sys.argv[1:] if a.startswith("--config.")]
  sys.argv = [a for a in sys.argv if not a.startswith("--config.")]
  app.run(lambda argv: main(argv + config_args))
