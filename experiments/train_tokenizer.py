"""Trains a tokenizer on a corpus, offline: byte-level BPE (Hugging Face `tokenizers`) or a
SentencePiece BPE model.

  python experiments/train_tokenizer.py --corpus='text:books/*.txt' --vocab_size=8000 \
      --out=runs/tok                       # writes runs/tok/tokenizer.json
  python experiments/train.py ... --config.data.tokenizer=runs/tok/tokenizer.json

An existing tokenizer file in --out is refused (a run may be reading it); --overwrite writes the new
one beside it and renames it into place.
"""

import sys

from absl import app, flags

_CORPUS = flags.DEFINE_string("corpus", None, "A data.corpus (docs/data.md); its text trains the "
                              "tokenizer.", required=True)
_VOCAB = flags.DEFINE_integer("vocab_size", 8000, "Tokens in the vocabulary, >= 300.")
_OUT = flags.DEFINE_string("out", None, "Folder to write tokenizer.json (or tokenizer.model) into.",
                           required=True)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing tokenizer file in --out "
                                "(written beside it, then renamed into place).")
_KIND = flags.DEFINE_enum("kind", "bpe", ["bpe", "sentencepiece"],
                          "bpe: byte-level BPE, tokenizer.json; sentencepiece: tokenizer.model.")


def main(argv):
  del argv
  from lowcomm_jax.data import corpora, files, tokenizer  # pylint: disable=g-import-not-at-top
  try:
    if _VOCAB.value < 300:
      raise ValueError(f"--vocab_size must be >= 300 (the 256 bytes and merges), "
                       f"got {_VOCAB.value}")
    files.refuse_existing(tokenizer.output_file(_OUT.value, _KIND.value), _OVERWRITE.value)
    corpora.check_available(_CORPUS.value)
    texts = [text for _, text in corpora.load_documents(_CORPUS.value)]
  except ValueError as error:
    sys.exit(f"ValueError: {error}")
  train = tokenizer.train_bpe if _KIND.value == "bpe" else tokenizer.train_sentencepiece
  path = train(texts, _VOCAB.value, _OUT.value, overwrite=_OVERWRITE.value)
  print(f"wrote {path} ({tokenizer.load_tokenizer(str(path)).vocab_size} tokens)")


if __name__ == "__main__":
  app.run(main)
