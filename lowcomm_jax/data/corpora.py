"""Every `data.corpus` name, read: documents, availability checks, and identity.

  stdlib | licenses | docstrings   installed with the package (`lowcomm_jax.data.portable`)
  debian:<source>                  fetched by `experiments/fetch_corpora.py` into a cache folder
                                   (`lowcomm_jax.data.debian`)
  domain:<d> | domain_mix:<d>+...  an HDEE domain, or a mix of domains' training text
                                   (`lowcomm_jax.data.domains`)
  text: | jsonl: | parquet: | hf: | tokens:   the user's own files (`lowcomm_jax.data.files`)
"""

from __future__ import annotations

import functools
import hashlib
import json
import zlib

from lowcomm_jax.data import debian, domains, files, portable, tokenizer as tokenizer_lib
from lowcomm_jax.data.portable import CORPORA, Document


def load_documents(name: str) -> tuple[Document, ...]:
  """Documents of a named corpus: one of CORPORA, `debian:<source>` once fetched,
  `domain_mix:<a>+<b>`, or the user's files (read each time: they may change)."""
  if files.is_file_corpus(name):
    return tuple(files.documents(name))
  return _named_documents(name)


@functools.lru_cache(maxsize=8)
def _named_documents(name: str) -> tuple[Document, ...]:
  if name in CORPORA:
    return portable.documents(name)
  if name.startswith("debian:"):
    return tuple(debian.load_documents(name.split(":", 1)[1]))
  if name.startswith("domain_mix:"):
    return tuple(domains.mix_documents(domains.mix_domains(name)))
  raise ValueError(f"data.corpus must be one of {sorted(CORPORA)}, 'debian:<source>', "
                   f"'domain_mix:<domain>+...' or {files.FORMS}, got {name!r}")


def check_available(name: str) -> None:
  """Raises a ValueError naming `data.corpus`, the allowed values and the fetch command when the
  corpus is unknown or not fetched; reads nothing but names and marker files."""
  if name in CORPORA:
    return
  if files.is_file_corpus(name):
    files.check(name)
    return
  kind, _, rest = str(name).partition(":")
  if kind == "debian":
    if rest not in debian.SOURCES:
      raise ValueError(f"data.corpus={name!r}: unknown Debian source {rest!r}; allowed: "
                       f"{', '.join('debian:' + s for s in debian.SOURCES)}")
    if not debian.is_fetched(rest):
      raise ValueError(f"data.corpus={name!r} is not fetched into {debian.default_cache_dir()}; "
                       f"fetch it first with: {debian.FETCH_COMMAND.format(names=rest)}")
    return
  if kind in ("domain", "domain_mix"):
    names = rest.split("+") if kind == "domain_mix" else [rest]
    for domain in names:
      if domain not in domains.DOMAINS:
        raise ValueError(f"data.corpus={name!r}: unknown domain {domain!r}; allowed: "
                         f"{', '.join(kind + ':' + d for d in domains.DOMAINS)}")
      check_available(domains.DOMAINS[domain].corpus)
    return
  raise ValueError(f"data.corpus must be one of {sorted(CORPORA)}, 'debian:<source>', "
                   f"'domain:<domain>', 'domain_mix:<domain>+<domain>...' or one of the file forms "
                   f"{files.FORMS}, got {name!r}")


def _files_of(name: str) -> list[tuple[str, int]]:
  """(path, size) of every file corpus `name` is read from."""
  if name in CORPORA:
    return portable.files_of(name)
  if files.is_file_corpus(name):
    return files.identity_files(name)
  kind, _, rest = name.partition(":")
  if kind in ("domain", "domain_mix"):
    return [(f"{domain}/{path}", size) for domain in rest.split("+")
            for path, size in _files_of(domains.DOMAINS[domain].corpus)]
  folder = debian.SOURCES[rest].folder()
  return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*")
                if p.is_file() and not p.is_symlink())


def corpus_identity(name: str, tokenizer: str = "bytes") -> str:
  """A hash of the list of files corpus `name` is read from and their sizes (of its documents, for a
  corpus a user registered in CORPORA), and of the tokenizer's files (none for bytes).

  It changes when the text may have changed (another Python's stdlib, another numpy, another Debian
  release of a package), so a run records it and a resume on other text is refused. Stat calls
  only: about 0.1 s for `stdlib`.
  """
  check_available(name)
  if files.is_file_corpus(name):  # the user's files may change between two starts: never cached
    text = json.dumps(_files_of(name))
  else:
    text = _identity(name, str(debian.default_cache_dir()))
  tokens = tokenizer_lib.identity(tokenizer)
  if not tokens and not files.is_file_corpus(name):
    return text  # as before tokenizers existed, so that those runs resume
  return hashlib.sha256((text + "|" + tokens).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=16)
def _identity(name: str, cache_dir: str) -> str:
  del cache_dir  # part of the cache key only: the Debian corpora are read from there
  return hashlib.sha256(json.dumps(_files_of(name)).encode()).hexdigest()[:16]


def is_eval_document(doc_id: str, eval_permille: int) -> bool:
  """Held-out split by a hash of the document id: stable across machines and runs."""
  return zlib.crc32(doc_id.encode("utf-8")) % 1000 < eval_permille
