"""HDEE's chains: the training domains grouped by measured difficulty, and byte-bigram stand-in
experts.

HDEE (docs/algorithms.md §4.1) trains three expert chains, each over three
domains in turn, and groups the chains by difficulty (hard, moderate, easy).
The paper uses M2D2 and web corpora from a hub; here the domains are the real
text on this machine that `lowcomm_jax.data.domains` names and splits (9
training domains, 7 held out, fixed there).

Which chain a training domain joins is measured: `difficulty` scores each
domain by the held-out bits per byte of a byte-bigram model counted on its
training split, and `assign_chains` puts the three hardest in the hard chain,
the next three in the moderate chain and the three easiest in the easy chain.
`REFERENCE_CHAINS` records the result on Debian 12 with Python 3.11, for runs
that must not depend on the machine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import zlib
from typing import Mapping, Sequence

import numpy as np

from lowcomm_jax.data import debian, domains as domains_lib, tokenizer as tokenizer_lib
from lowcomm_jax.data.domains import SPLITS, TRAIN_DOMAINS

CHAIN_NAMES = ("hard", "moderate", "easy")


# `measured_chains()` on Debian 12 (bookworm) packages and the Python 3.11
# standard library; bigram bits/byte in the comments. A test checks it still holds.
REFERENCE_CHAINS: dict[str, tuple[str, ...]] = {
    "hard": ("man_pages_dev", "foldoc", "python_docs"),     # 3.83, 3.78, 3.75
    "moderate": ("octave_manual", "stdlib", "wordnet"),     # 3.69, 3.62, 3.57
    "easy": ("austen", "gcide", "bible_kjv"),               # 3.53, 3.49, 3.32
}


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
  train = _evenly_spaced_sample(domains_lib.domain_bytes(name, "train", cache_key),
                                DIFFICULTY_TRAIN_BYTES)
  valid = _evenly_spaced_sample(domains_lib.domain_bytes(name, "validation", cache_key),
                                DIFFICULTY_EVAL_BYTES)
  compressed = len(zlib.compress(valid.tobytes(), 9))
  return Difficulty(bigram_bits_per_byte(train, valid), 8.0 * compressed / len(valid))


def difficulty(name: str, cache_dir: str | os.PathLike | None = None) -> Difficulty:
  """Measures a domain's difficulty from its train and validation splits."""
  return _difficulty(domains_lib.get_domain(name).name, str(debian.resolve_cache_dir(cache_dir)))


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
    domains_lib.get_domain(name)
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
  names = list(domains_lib.DOMAINS) if names is None else list(names)
  chain_of = {}
  if set(TRAIN_DOMAINS) <= set(names):
    chain_of = {d: c for c, ds in measured_chains(cache_dir).items() for d in ds}
  rows = []
  for name in names:
    domain, sizes = domains_lib.get_domain(name), domains_lib.split_sizes(name, cache_dir)
    score = difficulty(name, cache_dir)
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


def bigram_expert_tables(chains: Mapping[str, Sequence[str]],
                         cache_dir: str | os.PathLike | None = None,
                         max_bytes_per_domain: int = DIFFICULTY_TRAIN_BYTES
                         ) -> dict[str, np.ndarray]:
  """One byte-bigram "expert" per chain, counted on its domains' training splits."""
  return {chain: bigram_log_prob_table(np.concatenate(
      [_evenly_spaced_sample(domains_lib.domain_bytes(name, "train", cache_dir),
                             max_bytes_per_domain) for name in names])) for chain,
          names in chains.items()}


def bigram_expert_log_probs(tables: Sequence[np.ndarray], tokens_BxT: np.ndarray) -> np.ndarray:
  """Per-token log-probabilities of each bigram expert, [E, B, T], for `ensemble`."""
  return np.stack([bigram_token_log_probs(table, tokens_BxT) for table in tables])
