"""HDEE domains: real text in 9 training domains (three chains of three) and 7 held-out ones.

HDEE (PAPERS.md 4.1) trains three expert chains, each over three domains in
turn, and groups the chains by difficulty (hard, moderate, easy). The paper
uses M2D2 and web corpora from a hub; here every domain is text that is on
this machine: three portable corpora from `lowcomm_jax.data.corpora` and
Debian-packaged corpora from `lowcomm_jax.data.debian` (fetched once with
``python experiments/fetch_corpora.py --sources=all``).

Which domains train and which are held out is fixed here. Most held-out
domains have a relative among the training ones (the Jargon File and FOLDOC,
the R and Maxima manuals and Octave's, man pages 1/5/7/8 and 2/3, scipy's
docstrings and the standard library), so the ensemble's routing is tested on
text near, but not in, its experts' domains; licence texts and fortunes are
far from all. Which chain a training domain joins is measured: `difficulty`
scores each domain by the held-out bits per byte of a byte-bigram model
counted on its training split, and `assign_chains` puts the three hardest in
the hard chain, the next three in the moderate chain and the three easiest in
the easy chain. `REFERENCE_CHAINS` records the result on Debian 12 with
Python 3.11, for runs that must not depend on the machine.

| domain | role | source | licence |
|---|---|---|---|
| stdlib | train | Python standard library source (`corpora`) | PSF-2.0 |
| python_docs | train | Python 3.11 docs, reST (`python3.11-doc`) | PSF-2.0 |
| octave_manual | train | GNU Octave manual, info (`octave-doc`) | GPL-3+ |
| man_pages_dev | train | Linux man pages 2 and 3 (`manpages-dev`) | man-pages copyleft, GPL-2+, BSD |
| foldoc | train | Free On-line Dictionary of Computing (`dict-foldoc`) | GFDL-1.1+ |
| gcide | train | GNU Collaborative Intl. Dictionary of English (`dict-gcide`) | GPL-2+ |
| wordnet | train | WordNet 3.0 glosses (`wordnet-base`) | WordNet 3.0 licence |
| austen | train | Jane Austen's six novels (`r-cran-janeaustenr`) | public domain (R package MIT) |
| bible_kjv | train | King James Bible (`bible-kjv-text`) | public domain |
| docstrings | held out | numpy and scipy docstrings (`corpora`) | BSD-3-Clause |
| licenses | held out | SPDX licence texts (`licenseclassifier`) | each its own; collection Apache-2.0 |
| jargon | held out | The Jargon File 4.4.7 (`jargon-text`) | public domain |
| fortunes | held out | BSD fortune cookies (`fortunes`) | BSD (fortune-mod) |
| r_manuals | held out | R 4.2 manuals, info (`r-doc-info`) | GPL-2 |
| maxima_manual | held out | Maxima 5.46 manual, info (`maxima-doc`) | GPL-2 |
| man_pages | held out | Linux man pages 1, 4, 5, 7, 8 (`manpages`) | man-pages copyleft, GPL-2+, BSD |

Splits are by document: a document goes to train, validation or test by a
hash of ``domain/doc_id`` (80/10/10), which is deterministic, disjoint, and
stable when other documents are added. A domain with fewer than
`MIN_DOCUMENTS_TO_HASH` documents, or whose hash leaves a split empty, is
split by contiguous byte ranges of its concatenated text instead.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import zlib
from typing import Mapping, Sequence

import numpy as np

from lowcomm_jax.data import corpora
from lowcomm_jax.data import debian
from lowcomm_jax.data import tokenizer as tokenizer_lib

SPLITS = ("train", "validation", "test")
# Cumulative fractions of train and train+validation (the paper's 80/10/10).
_SPLIT_EDGES = (0.8, 0.9)
MIN_DOCUMENTS_TO_HASH = 30
CHAIN_NAMES = ("hard", "moderate", "easy")
Documents = list[tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class Domain:
  """One HDEE domain.

  Attributes:
    name: the domain's key in `DOMAINS`.
    corpus: ``stdlib``, ``licenses`` or ``docstrings`` (portable, from
      `lowcomm_jax.data.corpora`), or ``debian:<source>``.
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


# `measured_chains()` on Debian 12 (bookworm) packages and the Python 3.11
# standard library; bigram bits/byte in the comments. A test checks it still holds.
REFERENCE_CHAINS: dict[str, tuple[str, ...]] = {
    "hard": ("man_pages_dev", "foldoc", "python_docs"),     # 3.83, 3.78, 3.75
    "moderate": ("octave_manual", "stdlib", "wordnet"),     # 3.69, 3.62, 3.57
    "easy": ("austen", "gcide", "bible_kjv"),               # 3.53, 3.49, 3.32
}


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
  return str(debian.default_cache_dir() if cache_dir is None else cache_dir)


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
    docs = list(corpora.load_documents(domain.corpus))
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


def split_sizes(name: str, cache_dir: str | os.PathLike | None = None) -> dict[str, tuple[int, int]]:
  """``{split: (num_documents, num_bytes)}`` of one domain."""
  return {split: (len(docs), sum(len(t.encode("utf-8")) + 1 for _, t in docs))
          for split, docs in zip(SPLITS, _splits(get_domain(name).name, _cache_key(cache_dir)))}


# ---------------------------------------------------------------------------
# Difficulty
# ---------------------------------------------------------------------------

# The bigram is counted on at most this many training bytes and scored on at
# most this many validation bytes, so every domain is measured with the same
# amount of evidence (held-out bits/byte falls as the training text grows).
DIFFICULTY_TRAIN_BYTES = 2_000_000
DIFFICULTY_EVAL_BYTES = 250_000
_SAMPLE_BLOCKS = 50


@dataclasses.dataclass(frozen=True)
class Difficulty:
  """How hard a domain is to predict, measured on its own text.

  Attributes:
    bigram_bits_per_byte: held-out cross-entropy (bits/byte) on the validation
      split of a byte-bigram model counted on the training split; the score
      chains are assigned by.
    zlib_bits_per_byte: validation bytes compressed by zlib level 9, in bits
      per input byte; a second opinion that sees longer repeats.
  """

  bigram_bits_per_byte: float
  zlib_bits_per_byte: float


def _evenly_spaced_sample(stream: np.ndarray, max_bytes: int) -> np.ndarray:
  """Blocks spread over the whole stream, so a sorted corpus is not read from its start only."""
  if len(stream) <= max_bytes:
    return stream
  block = max_bytes // _SAMPLE_BLOCKS
  starts = np.linspace(0, len(stream) - block, _SAMPLE_BLOCKS).astype(np.int64)
  return np.concatenate([stream[s:s + block] for s in starts])


def bigram_log_prob_table(train: np.ndarray, smoothing: float = 0.01) -> np.ndarray:
  """A byte-bigram model: ``table[a, b] = log p(next byte b | byte a)``, [256, 256].

  Counted on the uint8 stream `train` with add-`smoothing` counts, so unseen
  pairs stay finite. Also a cheap "expert" for ensemble demonstrations.
  """
  train = np.asarray(train, np.int64)
  counts = np.bincount(train[:-1] * 256 + train[1:], minlength=256 * 256)
  counts = counts.reshape(256, 256).astype(np.float64) + smoothing
  return np.log(counts / counts.sum(axis=1, keepdims=True))


def bigram_token_log_probs(table: np.ndarray, tokens_BxT: np.ndarray) -> np.ndarray:
  """``log p(x_t | x_{t-1})`` of each byte under `table`, [B, T].

  The first byte of each row is conditioned on the document separator, as if
  the row started a document.
  """
  tokens_BxT = np.asarray(tokens_BxT, np.int64)
  previous_BxT = np.concatenate(
      [np.full_like(tokens_BxT[:, :1], tokenizer_lib.DOC_SEPARATOR), tokens_BxT[:, :-1]], axis=1)
  return table[previous_BxT, tokens_BxT].astype(np.float32)


def bigram_bits_per_byte(train: np.ndarray, evaluate: np.ndarray,
                         smoothing: float = 0.01) -> float:
  """Cross-entropy in bits/byte of `evaluate` under a byte-bigram model of `train`."""
  table = bigram_log_prob_table(train, smoothing)
  evaluate = np.asarray(evaluate, np.int64)
  return float(-table[evaluate[:-1], evaluate[1:]].mean() / math.log(2))


@functools.lru_cache(maxsize=32)
def _difficulty(name: str, cache_key: str) -> Difficulty:
  train = _evenly_spaced_sample(domain_bytes(name, "train", cache_key), DIFFICULTY_TRAIN_BYTES)
  valid = _evenly_spaced_sample(domain_bytes(name, "validation", cache_key),
                                DIFFICULTY_EVAL_BYTES)
  compressed = len(zlib.compress(valid.tobytes(), 9))
  return Difficulty(bigram_bits_per_byte(train, valid), 8.0 * compressed / len(valid))


def difficulty(name: str, cache_dir: str | os.PathLike | None = None) -> Difficulty:
  """Measures a domain's difficulty from its train and validation splits."""
  return _difficulty(get_domain(name).name, _cache_key(cache_dir))


def assign_chains(scores: Mapping[str, float],
                  domains: Sequence[str] = TRAIN_DOMAINS) -> dict[str, tuple[str, ...]]:
  """Groups training domains into hard, moderate and easy chains by a difficulty score.

  The hardest third (highest score) forms the hard chain, and so on. Within a
  chain the domains are ordered hardest first, which is the order the expert
  trains on them (each iteration continues from the previous checkpoint).

  Args:
    scores: domain name -> difficulty (higher is harder), e.g. bigram bits/byte.
    domains: the training domains; their number must be a multiple of 3.

  Returns:
    ``{"hard": (d1, d2, d3), "moderate": (...), "easy": (...)}``.
  """
  for name in domains:
    get_domain(name)
  missing = [name for name in domains if name not in scores]
  if missing:
    raise ValueError(f"assign_chains: no difficulty score for {missing}")
  if not domains or len(domains) % len(CHAIN_NAMES):
    raise ValueError(f"assign_chains: need a multiple of {len(CHAIN_NAMES)} domains, "
                     f"got {len(domains)}")
  # Ties are broken by name so that the assignment is deterministic.
  ordered = sorted(domains, key=lambda n: (-scores[n], n))
  per_chain = len(ordered) // len(CHAIN_NAMES)
  return {chain: tuple(ordered[i * per_chain:(i + 1) * per_chain])
          for i, chain in enumerate(CHAIN_NAMES)}


def measured_chains(cache_dir: str | os.PathLike | None = None) -> dict[str, tuple[str, ...]]:
  """`assign_chains` on the measured bigram bits/byte of every training domain."""
  return assign_chains({n: difficulty(n, cache_dir).bigram_bits_per_byte for n in TRAIN_DOMAINS})


def domains_table(cache_dir: str | os.PathLike | None = None,
                  names: Sequence[str] | None = None) -> list[dict]:
  """One row per domain: sizes, difficulty, role and chain (training domains)."""
  names = list(DOMAINS) if names is None else list(names)
  chain_of = {}
  if set(TRAIN_DOMAINS) <= set(names):
    chain_of = {d: c for c, ds in measured_chains(cache_dir).items() for d in ds}
  rows = []
  for name in names:
    domain, sizes, score = get_domain(name), split_sizes(name, cache_dir), difficulty(name, cache_dir)
    rows.append({
        "domain": name, "corpus": domain.corpus, "licence": domain.licence,
        "documents": {s: n for s, (n, _) in sizes.items()},
        "bytes": {s: b for s, (_, b) in sizes.items()},
        "bigram_bits_per_byte": round(score.bigram_bits_per_byte, 3),
        "zlib_bits_per_byte": round(score.zlib_bits_per_byte, 3),
        "chain": "held out" if domain.held_out else chain_of.get(name, "?"),
    })
  return rows


def format_domains_table(rows: Sequence[dict]) -> str:
  """Markdown for `domains_table` rows, hardest training chain first."""
  order = {c: i for i, c in enumerate(CHAIN_NAMES + ("?", "held out"))}
  lines = ["| domain | source | licence | train / val / test MB | bigram bits/byte | "
           "zlib bits/byte | chain |", "|---|---|---|---|---|---|---|"]
  for row in sorted(rows, key=lambda r: (order[r["chain"]], -r["bigram_bits_per_byte"])):
    megabytes = " / ".join(f"{row['bytes'][s] / 1e6:.2f}" for s in SPLITS)
    lines.append(f"| {row['domain']} | {row['corpus']} | {row['licence']} | {megabytes} | "
                 f"{row['bigram_bits_per_byte']:.3f} | {row['zlib_bits_per_byte']:.3f} | "
                 f"{row['chain']} |")
  return "\n".join(lines)


# ---------------------------------------------------------------------------
# Byte-bigram experts: cheap stand-ins for trained experts in demonstrations
# ---------------------------------------------------------------------------


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


def bigram_expert_tables(chains: Mapping[str, Sequence[str]],
                         cache_dir: str | os.PathLike | None = None,
                         max_bytes_per_domain: int = DIFFICULTY_TRAIN_BYTES
                         ) -> dict[str, np.ndarray]:
  """One byte-bigram "expert" per chain, counted on its domains' training splits."""
  return {chain: bigram_log_prob_table(np.concatenate(
      [_evenly_spaced_sample(domain_bytes(name, "train", cache_dir), max_bytes_per_domain)
       for name in names])) for chain, names in chains.items()}


def bigram_expert_log_probs(tables: Sequence[np.ndarray], tokens_BxT: np.ndarray) -> np.ndarray:
  """Per-token log-probabilities of each bigram expert, [E, B, T], for `ensemble`."""
  return np.stack([bigram_token_log_probs(table, tokens_BxT) for table in tables])
