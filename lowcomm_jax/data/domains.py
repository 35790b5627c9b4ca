"""Named text domains (9 training, 7 held out), their train/validation/test splits and mixes.

A domain is one corpus with a fixed role: training domains are the text that
models are trained on one at a time (HDEE's expert chains, `lowcomm_jax.hdee`),
held-out domains are only evaluated. Every domain is text that is on this
machine: three portable corpora from `lowcomm_jax.data.portable` and
Debian-packaged corpora from `lowcomm_jax.data.debian` (fetched once with
``python experiments/fetch_corpora.py --sources=all``). Most held-out domains
have a relative among the training ones (the Jargon File and FOLDOC, the R and
Maxima manuals and Octave's, man pages 1/5/7/8 and 2/3, scipy's docstrings and
the standard library); licence texts and fortunes are far from all.

| domain | role | source | licence |
|---|---|---|---|
| stdlib | train | Python standard library source (`portable`) | PSF-2.0 |
| python_docs | train | Python 3.11 docs, reST (`python3.11-doc`) | PSF-2.0 |
| octave_manual | train | GNU Octave manual, info (`octave-doc`) | GPL-3+ |
| man_pages_dev | train | man pages 2 and 3 (`manpages-dev`) | man-pages copyleft, GPL-2+, BSD |
| foldoc | train | Free On-line Dictionary of Computing (`dict-foldoc`) | GFDL-1.1+ |
| gcide | train | GNU Collaborative Intl. Dictionary of English (`dict-gcide`) | GPL-2+ |
| wordnet | train | WordNet 3.0 glosses (`wordnet-base`) | WordNet 3.0 licence |
| austen | train | Jane Austen's six novels (`r-cran-janeaustenr`) | public domain (R package MIT) |
| bible_kjv | train | King James Bible (`bible-kjv-text`) | public domain |
| docstrings | held out | numpy and scipy docstrings (`portable`) | BSD-3-Clause |
| licenses | held out | SPDX licence texts (`licenseclassifier`) | each its own; all: Apache-2.0 |
| jargon | held out | The Jargon File 4.4.7 (`jargon-text`) | public domain |
| fortunes | held out | BSD fortune cookies (`fortunes`) | BSD (fortune-mod) |
| r_manuals | held out | R 4.2 manuals, info (`r-doc-info`) | GPL-2 |
| maxima_manual | held out | Maxima 5.46 manual, info (`maxima-doc`) | GPL-2 |
| man_pages | held out | man pages 1, 4, 5, 7, 8 (`manpages`) | man-pages copyleft, GPL-2+, BSD |

Splits are by document: a document goes to train, validation or test by a
hash of ``domain/doc_id`` (80/10/10), which is deterministic, disjoint, and
stable when other documents are added. A domain with fewer than
`MIN_DOCUMENTS_TO_HASH` documents, or whose hash leaves a split empty, is
split by contiguous byte ranges of its concatenated text instead.

The Trainer reads a domain as ``data.corpus = "domain:<name>"`` (its train and
validation splits) and a mix of domains as ``"domain_mix:<a>+<b>+..."``
(`mix_documents`: equal samples of their training splits, in chunks, split
into train and eval text like any other corpus).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Sequence

import numpy as np

from lowcomm_jax.data import debian, portable, tokenizer as tokenizer_lib

SPLITS = ("train", "validation", "test")
# Cumulative fractions of train and train+validation (the paper's 80/10/10).
_SPLIT_EDGES = (0.8, 0.9)
MIN_DOCUMENTS_TO_HASH = 30
Documents = list[tuple[str, str]]
# `data.corpus` of a mix of domains: MIX_PREFIX + "+".join(domain names).
MIX_PREFIX = "domain_mix:"
# Bytes of each domain in a mix, cut into chunks of this size (small chunks, so that the
# Trainer's 2% held-out documents are never an empty set).
MIX_BYTES_PER_DOMAIN = 1 << 19
MIX_CHUNK_BYTES = 1 << 12


@dataclasses.dataclass(frozen=True)
class Domain:
  """One named domain of text.

  Attributes:
    name: the domain's key in `DOMAINS`.
    corpus: ``stdlib``, ``licenses`` or ``docstrings`` (portable, from
      `lowcomm_jax.data.portable`), or ``debian:<source>``.
    description: what the text is.
    licence: the licence of the text.
    held_out: True when no expert trains on it (evaluation only).
  """

  name: str
  corpus: str
  description: str
  licence: str
  held_out: bool

  @property
  def needs_fetch(self) -> bool:
    return self.corpus.startswith("debian:")


def _debian_domain(name: str, held_out: bool) -> Domain:
  source = debian.SOURCES[name]
  return Domain(name, f"debian:{name}", source.description, source.licence, held_out)


DOMAINS: dict[str, Domain] = {d.name: d for d in [
    Domain("stdlib", "stdlib", "Python standard library source code, one file per document",
           "PSF-2.0", held_out=False),
    _debian_domain("python_docs", held_out=False),
    _debian_domain("octave_manual", held_out=False),
    _debian_domain("man_pages_dev", held_out=False),
    _debian_domain("foldoc", held_out=False),
    _debian_domain("gcide", held_out=False),
    _debian_domain("wordnet", held_out=False),
    _debian_domain("austen", held_out=False),
    _debian_domain("bible_kjv", held_out=False),
    Domain("docstrings", "docstrings", "docstrings of numpy and scipy, one module per document",
           "BSD-3-Clause", held_out=True),
    Domain("licenses", "licenses", "SPDX licence texts from licenseclassifier, one per document",
           "each text its own terms; collection Apache-2.0", held_out=True),
    _debian_domain("jargon", held_out=True),
    _debian_domain("fortunes", held_out=True),
    _debian_domain("r_manuals", held_out=True),
    _debian_domain("maxima_manual", held_out=True),
    _debian_domain("man_pages", held_out=True),
]}
TRAIN_DOMAINS: tuple[str, ...] = tuple(n for n, d in DOMAINS.items() if not d.held_out)
HELD_OUT_DOMAINS: tuple[str, ...] = tuple(n for n, d in DOMAINS.items() if d.held_out)


def get_domain(name: str) -> Domain:
  """Returns the domain called `name`, or raises a ValueError naming the allowed ones."""
  if name not in DOMAINS:
    raise ValueError(f"unknown HDEE domain {name!r}; allowed: {', '.join(DOMAINS)}")
  return DOMAINS[name]


def fetch_domains(names: Sequence[str] | None = None,
                  cache_dir: str | os.PathLike | None = None) -> None:
  """Fetches the Debian sources of the domains `names` (default: all) not yet cached.

  About 10 s for all of them on a fresh machine (one apt-get download call).
  """
  names = list(DOMAINS) if names is None else list(names)
  sources = [get_domain(n).corpus.split(":", 1)[1] for n in names if get_domain(n).needs_fetch]
  debian.ensure_fetched(sources, cache_dir)


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")


def _cache_key(cache_dir) -> str:
  return str(debian.resolve_cache_dir(cache_dir))


def _hash_fraction(domain: str, doc_id: str) -> float:
  digest = hashlib.blake2b(f"{domain}/{doc_id}".encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "big") / 2.0**64


def _split_index(fraction: float) -> int:
  return sum(fraction >= edge for edge in _SPLIT_EDGES)


@functools.lru_cache(maxsize=32)
def _splits(name: str, cache_key: str) -> tuple[tuple[tuple[str, str], ...], ...]:
  domain = get_domain(name)
  if domain.needs_fetch:
    docs = debian.documents(domain.corpus.split(":", 1)[1], cache_key)
  else:
    docs = list(portable.documents(domain.corpus))
  if not docs:
    raise ValueError(f"domain {name!r} has no documents")
  parts: list[list[tuple[str, str]]] = [[], [], []]
  if len(docs) >= MIN_DOCUMENTS_TO_HASH:
    for doc_id, text in docs:
      parts[_split_index(_hash_fraction(name, doc_id))].append((doc_id, text))
  if not all(parts):
    # Too few documents to hash: cut the concatenated text by character ranges.
    text = "".join(t for _, t in docs)
    cuts = [0] + [int(len(text) * edge) for edge in _SPLIT_EDGES] + [len(text)]
    parts = [[(f"{name}[{cuts[i]}:{cuts[i + 1]}]", text[cuts[i]:cuts[i + 1]])]
             for i in range(3)]
  return tuple(tuple(p) for p in parts)


def domain_documents(name: str, split: str,
                     cache_dir: str | os.PathLike | None = None) -> Documents:
  """Documents of one split of one domain, in a deterministic order.

  Args:
    name: a key of `DOMAINS`.
    split: ``train``, ``validation`` or ``test``.
    cache_dir: the Debian corpus cache folder; None means the default
      (`lowcomm_jax.data.debian.default_cache_dir`).

  Returns:
    ``[(doc_id, text), ...]``.

  Raises:
    ValueError: unknown domain or split.
    lowcomm_jax.data.debian.NotFetchedError: a Debian domain not yet fetched
      (the message names the fetch command).
  """
  _check_split(split)
  return list(_splits(get_domain(name).name, _cache_key(cache_dir))[SPLITS.index(split)])


def domain_bytes(name: str, split: str,
                 cache_dir: str | os.PathLike | None = None) -> np.ndarray:
  """One split of one domain as a uint8 token stream for the byte tokenizer.

  Each document's UTF-8 bytes are followed by
  `lowcomm_jax.data.tokenizer.DOC_SEPARATOR` (NUL), exactly as
  `ByteTokenizer.encode_documents` lays out the default corpus.

  Args:
    name: a key of `DOMAINS`.
    split: ``train``, ``validation`` or ``test``.
    cache_dir: the Debian corpus cache folder; None means the default.

  Returns:
    uint8 array of shape [num_bytes], read-only (it is cached; copy to modify).
  """
  _check_split(split)
  return _domain_bytes(get_domain(name).name, split, _cache_key(cache_dir))


@functools.lru_cache(maxsize=64)
def _domain_bytes(name: str, split: str, cache_key: str) -> np.ndarray:
  docs = _splits(name, cache_key)[SPLITS.index(split)]
  stream = tokenizer_lib.ByteTokenizer().encode_documents(text for _, text in docs)
  stream.setflags(write=False)  # Shared between callers through the cache.
  return stream


def split_sizes(
  name: str, cache_dir: str | os.PathLike | None = None
) -> dict[str, tuple[int, int]]:
  """``{split: (num_documents, num_bytes)}`` of one domain."""
  return {split: (len(docs), sum(len(t.encode("utf-8")) + 1 for _, t in docs))
          for split, docs in zip(SPLITS, _splits(get_domain(name).name, _cache_key(cache_dir)))}




def domain_sequences(name: str, split: str, seq_len: int, num_sequences: int,
                     cache_dir: str | os.PathLike | None = None) -> np.ndarray:
  """The first `num_sequences` non-overlapping windows of a split, [N, seq_len] uint8.

  Raises:
    ValueError: the split is shorter than ``num_sequences * seq_len`` bytes.
  """
  stream = domain_bytes(name, split, cache_dir)
  needed = num_sequences * seq_len
  if seq_len < 1 or num_sequences < 1 or len(stream) < needed:
    raise ValueError(f"domain {name!r} split {split!r} has {len(stream)} bytes; "
                     f"{num_sequences} sequences of {seq_len} need {needed}")
  return stream[:needed].reshape(num_sequences, seq_len)


def mix_documents(names: Sequence[str]) -> Documents:
  """Equal samples of the training splits of the domains `names`, as documents.

  From each domain, evenly spaced chunks of `MIX_CHUNK_BYTES` bytes, up to
  `MIX_BYTES_PER_DOMAIN` in all (evenly spaced, so a sorted corpus is not read
  from its start only). Only training splits are read: a model trained on a mix
  has seen none of the domains' validation or test text. Document ids are
  ``<domain>/<chunk index>``.

  Raises:
    ValueError: an unknown domain.
  """
  docs = []
  for name in names:
    stream = domain_bytes(name, "train")
    count = max(1, min(len(stream) // MIX_CHUNK_BYTES, MIX_BYTES_PER_DOMAIN // MIX_CHUNK_BYTES))
    starts = np.linspace(0, max(len(stream) - MIX_CHUNK_BYTES, 0), count).astype(np.int64)
    for i, start in enumerate(starts):
      chunk = stream[start:start + MIX_CHUNK_BYTES].tobytes()
      docs.append((f"{name}/{i}", chunk.decode("utf-8", errors="replace")))
  return docs


def mix_corpus_name(names: Sequence[str]) -> str:
  """The `data.corpus` name of the mix of `names` (sorted, without repeats): ``domain_mix:a+b``.

  Raises:
    ValueError: no domain, or an unknown one.
  """
  names = tuple(sorted(set(names)))
  if not names:
    raise ValueError("a domain mix needs at least one domain")
  for name in names:
    get_domain(name)
  return MIX_PREFIX + "+".join(names)


def mix_domains(corpus: str) -> tuple[str, ...]:
  """The domains of a mix's corpus name (`mix_corpus_name`'s inverse)."""
  if not corpus.startswith(MIX_PREFIX):
    raise ValueError(f"{corpus!r} is not a domain mix (it must start with {MIX_PREFIX!r})")
  return tuple(corpus[len(MIX_PREFIX):].split("+"))
