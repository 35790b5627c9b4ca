"""Tokenizers (`data.tokenizer`): text to token ids and back, all local files, no download.

  bytes                     UTF-8 bytes are the tokens (vocabulary 256), no dependency, no training
  <dir>/ or <file>.json     a Hugging Face `tokenizers` file (tokenizer.json, or any local model
                            folder holding one), e.g. trained by experiments/train_tokenizer.py
  <file>.model              a SentencePiece model

Every tokenizer has `vocab_size`, `encode(text) -> ids`, `decode(ids) -> text`,
`encode_documents(texts) -> one stream` (each document followed by `eos_id`, the document
separator: a tokenizer.json's is the `eos_token` of a `tokenizer_config.json` beside it, else the
first of `EOS_TOKENS` it has), `files()` (its own files, to copy next to an exported model) and
`stream_dtype` (the narrowest unsigned dtype holding every id: uint8 for bytes, uint16 up to 65,536
tokens). The model's vocabulary follows the tokenizer: `model_vocab_size` pads it to a multiple of
128 (bytes keeps 256).

Bits per byte need the bytes each token stands for, counted on decoded text: `check_exact_bytes`
refuses a tokenizer whose decoding does not give back the text it encoded (WordPiece lowercases and
splits off punctuation). `sha256_of` names a tokenizer by the SHA-256 of its file, as a run and
the metadata of a pre-tokenized corpus record it.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from typing import Iterable, Protocol

import numpy as np

from lowcomm_jax.data import files as files_lib

DOC_SEPARATOR = 0  # NUL never occurs in the text corpora, so it marks document boundaries.
# End-of-text tokens looked for, in this order, in a tokenizer that does not say which is its own.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
VOCAB_MULTIPLE = 128
# Encoded and decoded by `check_exact_bytes`: a tokenizer bits per byte can trust gives it back.
ROUND_TRIP_TEXT = "Hello, World! It's 3.5 kB.\n  Naïve café: x = [1, 2];\tdone."


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int
  stream_dtype: type

  def encode(self, text: str) -> np.ndarray: ...
  def decode(self, ids) -> str: ...
  def encode_documents(self, texts: Iterable[str]) -> np.ndarray: ...
  def count_bytes(self, ids) -> int: ...
  def files(self) -> list[pathlib.Path]: ...


def _stream_dtype(vocab_size: int):
  return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65_536 else np.uint32


class _Base:
  """`encode_documents` and `stream_dtype` from `vocab_size`, `eos_id` and a batch encoder."""

  def _encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  @property
  def stream_dtype(self):
    return _stream_dtype(self.vocab_size)

  def count_bytes(self, ids) -> int:
    """UTF-8 bytes of the text `ids` stand for, each document separator counted as one byte."""
    ids = np.asarray(ids)
    separators = int(np.count_nonzero(ids == self.eos_id))
    return separators + len(self.decode(ids[ids != self.eos_id]).encode("utf-8"))

  def encode_documents(self, texts: Iterable[str]) -> np.ndarray:
    """One token stream: each document followed by `eos_id`."""
    eos = np.array([self.eos_id], self.stream_dtype)
    parts = []
    for ids in self._encode_batch([t.replace("\x00", "") for t in texts]):
      parts.append(np.asarray(ids, self.stream_dtype))
      parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros((0,), self.stream_dtype)


class ByteTokenizer(_Base):
  """Encodes text to its UTF-8 bytes and back."""

  vocab_size = 256
  eos_id = DOC_SEPARATOR
  spec = "bytes"

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

  def decode(self, ids) -> str:
    return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

  def count_bytes(self, ids) -> int:
    return len(ids)

  def files(self) -> list[pathlib.Path]:
    return []


class HFTokenizer(_Base):
  """A Hugging Face `tokenizers` JSON file; the document separator is its end-of-text token."""

  def __init__(self, path: pathlib.Path):
    import tokenizers  # pylint: disable=g-import-not-at-top
    self.path = path
    self.spec = str(path)
    try:
      self._tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust parser's errors are plain Exceptions
      raise ValueError(f"data.tokenizer={str(path)!r} is not a Hugging Face tokenizer.json "
                       f"({str(error).splitlines()[0][:160]})") from None
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    vocab = self._tok.get_vocab(with_added_tokens=True)
    eos = [vocab[t] for t in (_configured_eos(path), *EOS_TOKENS) if t in vocab]
    if not eos:
      raise ValueError(f"data.tokenizer={str(path)!r} has none of the end-of-text tokens "
                       f"{', '.join(EOS_TOKENS)} to separate documents; add one as a special token")
    self.eos_id = eos[0]

  def id_to_piece(self, i: int) -> str:
    return self._tok.id_to_token(int(i))

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, self.stream_dtype)

  def _encode_batch(self, texts):
    return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                            skip_special_tokens=False)

  def files(self) -> list[pathlib.Path]:
    folder = self.path.parent
    extra = [folder / n for n in ("tokenizer_config.json", "special_tokens_map.json")
             if (folder / n).is_file()]
    return [self.path] + extra


def _configured_eos(path: pathlib.Path) -> str | None:
  """The eos token that a `tokenizer_config.json` beside a tokenizer.json names (a Hugging Face
  model folder's, e.g. one exported by experiments/export.py), if any."""
  try:
    eos = json.loads((path.parent / "tokenizer_config.json").read_text()).get("eos_token")
  except (OSError, ValueError, AttributeError):
    return None
  return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


class SentencePieceTokenizer(_Base):
  """A SentencePiece `.model`; the document separator is its `</s>` (eos) piece."""

  def __init__(self, path: pathlib.Path):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    self.path = path
    self.spec = str(path)
    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      self._sp.Load(str(path))
    except (OSError, RuntimeError) as error:
      raise ValueError(f"data.tokenizer={str(path)!r} is not a SentencePiece model "
                       f"({str(error).splitlines()[0][:160]})") from None
    self.vocab_size = self._sp.GetPieceSize()
    self.eos_id = self._sp.eos_id()
    if self.eos_id < 0:
      raise ValueError(f"data.tokenizer={str(path)!r} has no eos piece (trained with eos_id=-1) to "
                       "separate documents; train it with an eos piece")

  def id_to_piece(self, i: int) -> str:
    return self._sp.IdToPiece(int(i))

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.EncodeAsIds(text), self.stream_dtype)

  def _encode_batch(self, texts):
    return self._sp.EncodeAsIds(texts)

  def decode(self, ids) -> str:
    return self._sp.DecodeIds([int(i) for i in np.asarray(ids).reshape(-1)])

  def files(self) -> list[pathlib.Path]:
    return [self.path]


def load_tokenizer(spec: str) -> Tokenizer:
  """The tokenizer `data.tokenizer` names: "bytes", a tokenizer.json (or a folder holding one), or a
  SentencePiece .model. Raises one ValueError naming data.tokenizer for anything else."""
  spec = str(spec)
  if spec == "bytes":
    return ByteTokenizer()
  path = pathlib.Path(spec).expanduser()
  if path.is_dir():
    path = path / "tokenizer.json"
  if not path.is_file():
    raise ValueError(f"data.tokenizer={spec!r}: no such file; allowed: 'bytes', a Hugging Face "
                     "tokenizer.json (or a folder holding one) or a SentencePiece .model")
  stat = path.stat()
  return _load(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(path: str, size: int, mtime_ns: int) -> Tokenizer:
  del size, mtime_ns  # part of the cache key: a rewritten file is loaded again
  p = pathlib.Path(path)
  if p.suffix == ".model":
    return SentencePieceTokenizer(p)
  if p.suffix == ".json":
    return HFTokenizer(p)
  raise ValueError(f"data.tokenizer={path!r}: unknown kind of file; allowed: 'bytes', a Hugging "
                   f"Face tokenizer.json (or a folder holding one) or a SentencePiece .model")


def sha256_of(tok) -> str:
  """"bytes" for the byte tokenizer, else the SHA-256 of the tokenizer's file (tokenizer.json or
  .model): what names it in a run's config.json and in a pre-tokenized corpus's metadata."""
  return "bytes" if not tok.files() else files_lib.sha256_file(tok.files()[0])


def check_exact_bytes(tok) -> None:
  """Raises one ValueError naming data.tokenizer unless decoding gives back the text encoded (the
  bytes per token that bits per byte divide by are counted on decoded text)."""
  if not tok.files():
    return
  back = tok.decode(tok.encode(ROUND_TRIP_TEXT))
  if back != ROUND_TRIP_TEXT:
    kind = ""
    if isinstance(tok, HFTokenizer):
      kind = f" (a {json.loads(tok.path.read_text()).get('model', {}).get('type', '?')} tokenizer)"
    raise ValueError(f"data.tokenizer={tok.spec!r}{kind} does not give back the text it encodes "
                     f"({ROUND_TRIP_TEXT[:13]!r} decodes as {back[:16]!r}), so bits per byte, "
                     "which count the decoded text's bytes, would be wrong; use a byte-level BPE "
                     "(experiments/train_tokenizer.py) or a SentencePiece model")


def model_vocab_size(vocab_size: int) -> int:
  """The model's embedding rows for a tokenizer of `vocab_size`: padded to a multiple of 128 (the
  byte tokenizer's 256 already is one)."""
  return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def identity(spec: str) -> str:
  """What a resumed run compares: "" for bytes (runs saved before tokenizers keep their identity),
  else the tokenizer's files' names and sizes."""
  if spec == "bytes":
    return ""
  return ",".join(f"{p.name}:{os.path.getsize(p)}" for p in load_tokenizer(spec).files())


def output_file(out_dir, kind: str) -> pathlib.Path:
  """The file `train_bpe` ("bpe") or `train_sentencepiece` writes into `out_dir`."""
  return pathlib.Path(out_dir) / ("tokenizer.json" if kind == "bpe" else "tokenizer.model")


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir,
              overwrite: bool = False) -> pathlib.Path:
  """Trains a byte-level BPE tokenizer (Hugging Face `tokenizers`, offline) with `<|endoftext|>` as
  its document separator; writes and returns `out_dir/tokenizer.json`. An existing one is refused
  (a run may be reading it) unless `overwrite`: then the new file is renamed onto it."""
  out = output_file(out_dir, "bpe")
  files_lib.refuse_existing(out, overwrite)
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKENS[0]],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  out.parent.mkdir(parents=True, exist_ok=True)
  with files_lib.new_file(out) as tmp:
    tok.save(str(tmp))
  return out


def train_sentencepiece(texts: Iterable[str], vocab_size: int, out_dir,
                        overwrite: bool = False) -> pathlib.Path:
  """Trains a SentencePiece BPE model with an eos piece; writes and returns
  `out_dir/tokenizer.model` (an existing one is refused unless `overwrite`, as `train_bpe`).

  Text is kept as it is (no normalization, whitespace kept, no dummy prefix) and unseen characters
  (newlines too: it trains on lines) fall back to bytes, so decode(encode(text)) == text.
  """
  import sentencepiece  # pylint: disable=g-import-not-at-top
  out = output_file(out_dir, "sentencepiece")
  files_lib.refuse_existing(out, overwrite)
  out.parent.mkdir(parents=True, exist_ok=True)
  prefix = out.with_name(f".tokenizer.{os.getpid()}")  # writes <prefix>.model and <prefix>.vocab
  with files_lib.new_file(out) as tmp, files_lib.new_file(out.with_suffix(".vocab")) as vocab:
    _train_sentencepiece(sentencepiece, texts, vocab_size, prefix)
    os.replace(f"{prefix}.model", tmp)
    os.replace(f"{prefix}.vocab", vocab)
  return out


def _train_sentencepiece(sentencepiece, texts, vocab_size: int, prefix: pathlib.Path) -> None:
  sentencepiece.SentencePieceTrainer.Train(
      sentence_iterator=iter(line for text in texts for line in text.splitlines() if line.strip()),
      model_prefix=str(prefix), vocab_size=vocab_size, model_type="bpe",
      byte_fallback=True, character_coverage=1.0, eos_id=2, bos_id=1, unk_id=0, pad_id=-1,
      normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
      split_by_whitespace=True, allow_whitespace_only_pieces=True,
      num_threads=1, minloglevel=2)
