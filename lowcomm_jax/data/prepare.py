"""Tokenizes a corpus once, in parallel, into the pre-tokenized `tokens:` format (`data.files`).

Documents go to worker processes in chunks, in order; each worker loads the tokenizer once and
returns its chunk's stream (each document followed by the tokenizer's document separator), which
the parent appends to the `.bin` file as it arrives. The metadata JSON beside it names the dtype,
the vocabulary size, the tokenizer (as given, and the SHA-256 of its file), the token count and the
SHA-256 of the ids (hashed as they are written, so a run records the file's identity without
reading it again); a run then trains on `tokens:<out>` with the same `data.tokenizer`.

An existing `out` (or its metadata) is refused: a run may be reading it. With `overwrite`, both are
written beside it and renamed into place, so a run that memory-mapped the old file keeps it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib

import numpy as np

from lowcomm_jax.data import corpora, files, tokenizer as tokenizer_lib

_WORKER_TOKENIZER = None


def _start_worker(spec: str) -> None:
  global _WORKER_TOKENIZER
  _WORKER_TOKENIZER = tokenizer_lib.load_tokenizer(spec)


def _encode_chunk(texts: list[str]) -> np.ndarray:
  return _WORKER_TOKENIZER.encode_documents(texts)


def token_dtype(vocab_size: int) -> str:
  """The narrowest of `files.TOKEN_DTYPES` that holds every id."""
  return "uint16" if vocab_size <= 65_536 else "uint32"


def _chunks(docs, size: int):
  chunk = []
  for _, text in docs:
    chunk.append(text)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


def prepare(corpus: str, tokenizer: str, out, workers: int = 0, chunk_documents: int = 64,
            doc_separator: str = "", doc_chars: int = 0, progress: bool = True,
            overwrite: bool = False) -> dict:
  """Writes `out` (.bin) and its metadata JSON for `corpus` tokenized by `tokenizer`; returns the
  metadata. `workers` processes (0: one per CPU core); documents cut as `load_splits` cuts them.
  The user's files are read one at a time and at most 4 chunks per worker are in flight, so a
  corpus larger than memory streams through."""
  out = pathlib.Path(out)
  if out.suffix != ".bin":
    raise ValueError(f"--out={out} must end in .bin (its metadata goes to "
                     f"{out.with_suffix('.json')})")
  for path in (out, out.with_suffix(".json")):
    files.refuse_existing(path, overwrite)
  corpora.check_available(corpus)
  if corpus.startswith("tokens:"):
    raise ValueError(f"--corpus={corpus!r} is already tokenized")
  tok = tokenizer_lib.load_tokenizer(tokenizer)
  source = (
    files.iter_documents(corpus) if files.is_file_corpus(corpus) else corpora.load_documents(corpus)
  )
  chunks = _chunks(files.cut(source, doc_separator, doc_chars), chunk_documents)
  dtype = token_dtype(tok.vocab_size)
  workers = workers or os.cpu_count() or 1
  out.parent.mkdir(parents=True, exist_ok=True)
  count = documents = 0
  sha = hashlib.sha256()
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  bar = tqdm(unit="doc", disable=not progress, desc=f"tokenizing {corpus}")
  # spawn: the parent may hold JAX's threads (a notebook), which a forked child must not inherit.
  context = multiprocessing.get_context("spawn")
  with files.new_file(out) as tmp_bin, files.new_file(out.with_suffix(".json")) as tmp_meta:
    with open(tmp_bin, "wb") as sink, context.Pool(workers, _start_worker, (tokenizer,)) as pool:
      while True:
        window = list(itertools.islice(chunks, 4 * workers))  # Pool.imap would read all at once
        if not window:
          break
        for chunk, ids in zip(window, pool.imap(_encode_chunk, window)):
          written = ids.astype(dtype).tobytes()
          sink.write(written)
          sha.update(written)
          count += len(ids)
          documents += len(chunk)
          bar.update(len(chunk))
    bar.close()
    if not documents:
      raise ValueError(f"--corpus={corpus!r} holds no documents")
    meta = {"dtype": dtype, "vocab_size": tok.vocab_size, "tokenizer": tokenizer,
            "tokenizer_sha256": tokenizer_lib.sha256_of(tok), "num_tokens": count,
            "eos_id": int(tok.eos_id), "corpus": corpus, "documents": documents,
            "sha256": sha.hexdigest()}
    tmp_meta.write_text(json.dumps(meta, indent=1) + "\n")
  return meta
