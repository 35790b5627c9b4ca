"""Corpora from the user's own files (`data.corpus`), read locally: no hub, no download.

  text:<glob>               text files (a folder: every file under it; `.gz` files are read
                            decompressed); a document per file, cut further by
                            data.doc_separator and data.doc_chars
  jsonl:<glob>:<field>      JSON Lines (`.gz` read decompressed); a document per line, its string
                            `field`
  parquet:<glob>:<column>   Parquet files (pyarrow); a document per row of string `column`
  hf:<folder>:<column>      a Hugging Face `datasets` Dataset or DatasetDict saved with
                            `save_to_disk`, read from its Arrow files with pyarrow (the `datasets`
                            package is not needed); a document per row of `column`
  tokens:<file>             pre-tokenized ids, `.bin` (raw uint16/uint32) or `.npy`, with a
                            metadata JSON beside it (`<file stem>.json`, as
                            experiments/prepare_data.py writes): {"dtype", "vocab_size",
                            "tokenizer", "num_tokens", "eos_id"}, and from prepare_data.py the
                            SHA-256 of the ids file and of the tokenizer's file ("sha256",
                            "tokenizer_sha256")

Text is UTF-8: a text or JSON Lines file holding NUL bytes, or whose undecodable bytes make more
than MAX_REPLACED of its characters U+FFFD, is no text (a binary or compressed file matched by the
glob) and is refused, naming it and how many of the matched files are like it.

Globs are sorted and `**` recurses, so the document order (and with the seed, the shuffle) is the
same on every machine. `check` reads names, sizes and headers only; `identity_files` is what a run's
corpus identity hashes (paths and sizes).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import importlib.util
import json
import os
import pathlib
from typing import Iterable, Iterator

import numpy as np

PREFIXES = ("text:", "jsonl:", "parquet:", "hf:", "tokens:")
FORMS = ("'text:<glob>', 'jsonl:<glob>:<field>', 'parquet:<glob>:<column>', "
         "'hf:<save_to_disk folder>:<column>', 'tokens:<file.bin|file.npy>'")
TOKEN_DTYPES = ("uint16", "uint32")
# The share of U+FFFD (undecodable bytes) above which a file is no UTF-8 text.
MAX_REPLACED = 0.01


def sha256_file(path) -> str:
  """The SHA-256 of a file's bytes, read in blocks."""
  sha = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      sha.update(block)
  return sha.hexdigest()


def refuse_existing(path, overwrite: bool, flag: str = "--out") -> None:
  """Raises unless `path` is new or `overwrite` is given: a run may be reading it."""
  if pathlib.Path(path).exists() and not overwrite:
    raise ValueError(f"{flag}={path} exists, and a run may be reading it; give a new path, or "
                     "--overwrite to replace it (written beside it, then renamed into place: a "
                     "reader keeps the old file)")


@contextlib.contextmanager
def new_file(path):
  """Yields a temporary path beside `path`, renamed onto `path` once the block ends without error
  (removed otherwise): a reader of the old file keeps it (its inode), never sees a torn new one."""
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def is_file_corpus(name: str) -> bool:
  return str(name).startswith(PREFIXES)


def _parse(name: str) -> tuple[str, str, str]:
  """(kind, glob or path, field or "") of a corpus spec; raises naming data.corpus."""
  kind, _, rest = name.partition(":")
  field = ""
  if kind in ("jsonl", "parquet", "hf"):
    rest, _, field = rest.rpartition(":")
    if not rest or not field:
      raise ValueError(f"data.corpus={name!r}: {kind} needs a path and a field, "
                       f"'{kind}:<{'folder' if kind == 'hf' else 'glob'}>:"
                       f"<{'field' if kind == 'jsonl' else 'column'}>'")
  if not rest:
    raise ValueError(f"data.corpus={name!r}: no path given; allowed forms: {FORMS}")
  return kind, rest, field


def _matches(name: str, pattern: str) -> list[pathlib.Path]:
  """Files a glob names, folders expanded to the files under them (hidden ones skipped), sorted."""
  found = []
  for match in sorted(glob.glob(str(pathlib.Path(pattern).expanduser()), recursive=True)):
    path = pathlib.Path(match)
    if path.is_dir():
      found.extend(sorted(p for p in path.rglob("*") if p.is_file()
                          and not any(part.startswith(".") for part in p.relative_to(path).parts)))
    elif path.is_file():
      found.append(path)
  if not found:
    raise ValueError(f"data.corpus={name!r}: {pattern!r} matches no file")
  for path in found:
    if path.stat().st_size == 0:
      raise ValueError(f"data.corpus={name!r}: {path} is empty; remove it or narrow the glob")
  return found


def _hf_arrow_files(name: str, folder: str) -> list[pathlib.Path]:
  """The Arrow files of a `save_to_disk` folder: a Dataset (state.json lists them) or a
  DatasetDict (dataset_dict.json lists its splits, each a Dataset folder)."""
  root = pathlib.Path(folder).expanduser()
  if (root / "dataset_dict.json").is_file():
    splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
    return [f for split in splits for f in _hf_arrow_files(name, str(root / split))]
  state = root / "state.json"
  if not state.is_file():
    raise ValueError(f"data.corpus={name!r}: {root} is not a folder written by datasets' "
                     "save_to_disk (no state.json or dataset_dict.json)")
  files = [root / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
  missing = [str(f) for f in files if not f.is_file()]
  if missing:
    raise ValueError(f"data.corpus={name!r}: {root}/state.json lists missing files {missing}")
  return files


def token_metadata(name: str) -> tuple[pathlib.Path, dict]:
  """(ids file, metadata) of `tokens:<file>`, checked against the file's size; reads no ids."""
  path = pathlib.Path(_parse(name)[1]).expanduser()
  if not path.is_file():
    raise ValueError(f"data.corpus={name!r}: no such file {path}")
  if path.suffix not in (".bin", ".npy"):
    raise ValueError(f"data.corpus={name!r}: pre-tokenized ids must be a .bin or .npy file")
  meta_path = path.with_suffix(".json")
  try:
    meta = json.loads(meta_path.read_text())
    dtype, vocab, count = str(meta["dtype"]), int(meta["vocab_size"]), int(meta["num_tokens"])
  except FileNotFoundError:
    raise ValueError(f"data.corpus={name!r}: no metadata {meta_path} beside it (JSON with dtype, "
                     "vocab_size, tokenizer, num_tokens, as experiments/prepare_data.py "
                     "writes)") from None
  except (ValueError, KeyError, TypeError) as error:
    raise ValueError(f"data.corpus={name!r}: metadata {meta_path} is not JSON with dtype, "
                     f"vocab_size, num_tokens ({type(error).__name__}: {error})") from None
  if dtype not in TOKEN_DTYPES:
    raise ValueError(f"data.corpus={name!r}: metadata dtype {dtype!r}; allowed: {TOKEN_DTYPES}")
  if vocab > np.iinfo(dtype).max + 1:
    raise ValueError(f"data.corpus={name!r}: metadata vocab_size {vocab} does not fit its "
                     f"dtype {dtype}")
  if path.suffix == ".npy":
    array = np.load(path, mmap_mode="r")
    if array.ndim != 1 or str(array.dtype) != dtype or array.size != count:
      raise ValueError(f"data.corpus={name!r}: {path} holds {array.dtype} {list(array.shape)}, its "
                       f"metadata says {dtype} [{count}]")
  else:
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size != count * itemsize:
      raise ValueError(f"data.corpus={name!r}: {path} has {size} bytes, its metadata says {count} "
                       f"{dtype} tokens ({count * itemsize} bytes)")
  if count < 2:
    raise ValueError(f"data.corpus={name!r}: {path} holds {count} tokens; at least 2 are needed")
  return path, meta


def check(name: str) -> None:
  """Raises one ValueError naming data.corpus when the files are missing, empty or malformed
  (names, sizes and headers only: the documents are read by `documents`)."""
  kind, rest, _ = _parse(name)
  if kind == "tokens":
    token_metadata(name)
  elif kind == "hf":
    _hf_arrow_files(name, rest)
  else:
    _matches(name, rest)
  if kind in ("parquet", "hf"):
    if importlib.util.find_spec("pyarrow") is None:
      raise ValueError(f"data.corpus={name!r} needs pyarrow (a dependency of lowcomm-jax): "
                       "pip install pyarrow")


def identity_files(name: str) -> list[tuple[str, int]]:
  """(path, size) of every file the corpus is read from."""
  kind, rest, field = _parse(name)
  if kind == "tokens":
    path, _ = token_metadata(name)
    files = [path, path.with_suffix(".json")]
  elif kind == "hf":
    files = _hf_arrow_files(name, rest)
  else:
    files = _matches(name, rest)
  return [(str(p), p.stat().st_size) for p in files] + ([("field", len(field))] if field else [])


def _strings(name: str, where: str, values, field: str) -> list[str]:
  bad = [i for i, v in enumerate(values) if not isinstance(v, str)]
  if bad:
    raise ValueError(f"data.corpus={name!r}: {where} row {bad[0]} "
                     f"has {type(values[bad[0]]).__name__} in {field!r}, not text")
  return values


def _arrow_column(name: str, table, path, column: str) -> list[str]:
  if column not in table.column_names:
    raise ValueError(f"data.corpus={name!r}: {path} has no column {column!r}; it has "
                     f"{table.column_names}")
  return _strings(name, str(path), table.column(column).to_pylist(), column)


def _read_arrow(path: pathlib.Path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  with pa.memory_map(str(path)) as source:
    try:  # save_to_disk writes the Arrow streaming format
      return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
      source.seek(0)
      return pa.ipc.open_file(source).read_all()


def _raw_bytes(path: pathlib.Path) -> bytes:
  return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


def _not_text(data: bytes) -> str | None:
  """Why `data` is not UTF-8 text (None when it is)."""
  if b"\x00" in data:
    return f"holds NUL bytes ({data.count(0)})"
  text = data.decode("utf-8", errors="replace")
  replaced = text.count("\ufffd")
  if replaced > MAX_REPLACED * max(len(text), 1):
    return (f"is not UTF-8 text ({replaced} of its {len(text)} characters are undecodable bytes, "
            f"more than {MAX_REPLACED:.0%})")
  return None


def read_text(name: str, path: pathlib.Path, matched: list[pathlib.Path]) -> str:
  """The text of one of a corpus's `matched` files (decompressed if `.gz`); raises naming it, and
  how many of `matched` are no text either, when it is no UTF-8 text."""
  try:
    data = _raw_bytes(path)
  except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
    raise ValueError(f"data.corpus={name!r}: {path} cannot be read ({type(error).__name__}: "
                     f"{error})") from None
  why = _not_text(data)
  if why is None:
    return data.decode("utf-8", errors="replace")
  rest = matched[matched.index(path) + 1:] if path in matched else []
  others = sum(1 for p in rest if _not_text(_raw_bytes(p)) is not None)
  raise ValueError(f"data.corpus={name!r}: {path} {why}; {1 + others} of the {len(matched)} files "
                   "matched are no text (binary or compressed other than .gz): remove them or "
                   "narrow the glob")


def documents(name: str) -> list[tuple[str, str]]:
  """(doc_id, text) of a text, jsonl, parquet or hf corpus, in file order."""
  docs = list(iter_documents(name))
  if not docs:
    raise ValueError(f"data.corpus={name!r} holds no documents")
  return docs


def iter_documents(name: str) -> Iterator[tuple[str, str]]:
  """`documents`, one file at a time (a Parquet or Arrow file is read whole): for corpora larger
  than memory, as experiments/prepare_data.py reads them."""
  kind, rest, field = _parse(name)
  if kind == "text":
    matched = _matches(name, rest)
    for path in matched:
      yield str(path), read_text(name, path, matched)
  elif kind == "jsonl":
    matched = _matches(name, rest)
    for path in matched:
      for number, line in enumerate(read_text(name, path, matched).split("\n"), 1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except ValueError as error:
          raise ValueError(f"data.corpus={name!r}: {path} line {number} is not JSON "
                           f"({error})") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
          raise ValueError(f"data.corpus={name!r}: {path} line {number} has no text field "
                           f"{field!r}")
        yield f"{path}:{number}", record[field]
  elif kind == "parquet":
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    for path in _matches(name, rest):
      schema = pq.read_schema(path)
      if field not in schema.names:
        raise ValueError(f"data.corpus={name!r}: {path} has no column {field!r}; it "
                         f"has {schema.names}")
      texts = _arrow_column(name, pq.read_table(path, columns=[field]), path, field)
      yield from ((f"{path}:{i}", t) for i, t in enumerate(texts))
  elif kind == "hf":
    for path in _hf_arrow_files(name, rest):
      texts = _arrow_column(name, _read_arrow(path), path, field)
      yield from ((f"{path}:{i}", t) for i, t in enumerate(texts))
  else:
    raise ValueError(f"data.corpus={name!r} holds token ids, not documents")


def read_tokens(name: str) -> tuple[np.ndarray, dict]:
  """The ids of `tokens:<file>` (memory-mapped) and its metadata."""
  path, meta = token_metadata(name)
  if path.suffix == ".npy":
    return np.load(path, mmap_mode="r"), meta
  return np.memmap(path, dtype=meta["dtype"], mode="r"), meta


def cut(docs: Iterable[tuple[str, str]], separator: str = "", max_chars: int = 0
        ) -> Iterator[tuple[str, str]]:
  """Documents split at `separator` (when given), then into pieces of at most `max_chars`
  characters (when > 0); piece k of document d is `d#k`. Empty pieces are dropped."""
  if not separator and max_chars <= 0:
    yield from docs
    return
  for doc_id, text in docs:
    parts = text.split(separator) if separator else [text]
    pieces = [p[i:i + max_chars] for p in parts for i in range(0, len(p), max_chars)] \
        if max_chars > 0 else parts
    pieces = [p for p in pieces if p.strip()]
    yield from ((f"{doc_id}#{k}", p) for k, p in enumerate(pieces))
