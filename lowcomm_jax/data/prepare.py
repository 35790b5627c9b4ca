"""Tokenizes a corpus once, in parallel, into the pre-tokenized `tokens:` format (`data.files`).

Documents go to worker processes in chunks, in order; each worker loads the tokenizer once and
returns its chunk's stream (each document followed by the tokenizer's document separator), which
the parent appends to the `.bin` file as it arrives. The metadata JSON beside it names the dtype,
the vocabulary size, the tokenizer and the token count; a run then trains on `tokens:<out>` with
the same `data.tokenizer`.
"""

from __future__ import annotations

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
            doc_separator: str = "", doc_chars: int = 0, progress: bool = True) -> dict:
  """Writes `out` (.bin) and its metadata JSON for `corpus` tokenized by `tokenizer`; returns the
  metadata. `workers` processes (0: one per CPU core); documents cut as `load_splits` cuts them.
  The user's files are read one at a time and at most 4 chunks per worker are in flight, so a
  corpus larger than memory streams through."""
  corpora.check_available(corpus)
  if corpus.startswith("tokens:"):
    raise ValueError(f"--corpus={corpus!r} is already tokenized")
  tok = tokenizer_lib.load_tokenizer(tokenizer)
  out = pathlib.Path(out)
  if out.suffix != ".bin":
    raise ValueError(f"--out={out} must end in .bin (its metadata goes "
                     f"to {out.with_suffix('.json')})")
  source = (
    files.iter_documents(corpus) if files.is_file_corpus(corpus) else corpora.load_documents(corpus)
  )
  chunks = _chunks(files.cut(source, doc_separator, doc_chars), chunk_documents)
  dtype = token_dtype(tok.vocab_size)
  workers = workers or os.cpu_count() or 1
  out.parent.mkdir(parents=True, exist_ok=True)
  count = documents = 0
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  bar = tqdm(unit="doc", disable=not progress, desc=f"tokenizing {corpus}")
  # spawn: the parent may hold JAX's threads (a notebook), which a forked child must not inherit.
  context = multiprocessing.get_context("spawn")
  with open(out, "wb") as sink, context.Pool(workers, _start_worker, (tokenizer,)) as pool:
    while True:
      window = list(itertools.islice(chunks, 4 * workers))  # Pool.imap would read all input at once
      if not window:
        break
      for chunk, ids in zip(window, pool.imap(_encode_chunk, window)):
        ids.astype(dtype).tofile(sink)
        count += len(ids)
        documents += len(chunk)
        bar.update(len(chunk))
  bar.close()
  if not documents:
    out.unlink()
    raise ValueError(f"--corpus={corpus!r} holds no documents")
  meta = {"dtype": dtype, "vocab_size": tok.vocab_size, "tokenizer": tokenizer,
          "num_tokens": count, "eos_id": int(tok.eos_id), "corpus": corpus, "documents": documents}
  out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
  return meta
