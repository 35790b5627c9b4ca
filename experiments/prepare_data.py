"""Tokenizes a corpus once, in parallel, into a `.bin` of token ids and its metadata JSON.

  python experiments/prepare_data.py --corpus='text:books/*.txt' \
      --tokenizer=runs/tok/tokenizer.json --out=data/books.bin --workers=8
  python experiments/train.py --config=experiments/configs/diloco.py --workdir=runs/books \
      --config.data.corpus=tokens:data/books.bin --config.data.tokenizer=runs/tok/tokenizer.json

An existing --out (or its metadata) is refused (a run may be reading it); --overwrite writes the new
files beside them and renames them into place, so a run that reads the old file keeps it.
"""

import json
import sys

from absl import app, flags

_CORPUS = flags.DEFINE_string("corpus", None, "A data.corpus: a shipped corpus or text:/jsonl:/"
                              "parquet:/hf: files (docs/data.md).", required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "A data.tokenizer: bytes, a tokenizer.json "
                                 "(or its folder) or a SentencePiece .model.")
_OUT = flags.DEFINE_string("out", None, "The .bin to write; its metadata goes beside it as .json.",
                           required=True)
_WORKERS = flags.DEFINE_integer("workers", 0, "Tokenizing processes; 0: one per CPU core.")
_SEPARATOR = flags.DEFINE_string("doc_separator", "", "As data.doc_separator.")
_DOC_CHARS = flags.DEFINE_integer("doc_chars", 0, "As data.doc_chars.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out and its metadata "
                               "(written beside them, then renamed into place).")


def main(argv):
  del argv
  from lowcomm_jax.data import prepare  # pylint: disable=g-import-not-at-top
  try:
    meta = prepare.prepare(_CORPUS.value, _TOKENIZER.value, _OUT.value, _WORKERS.value,
                           doc_separator=_SEPARATOR.value, doc_chars=_DOC_CHARS.value,
                           progress=sys.stderr.isatty(), overwrite=_OVERWRITE.value)
  except ValueError as error:
    sys.exit(f"ValueError: {error}")
  print(json.dumps(meta))


if __name__ == "__main__":
  app.run(main)
