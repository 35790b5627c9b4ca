"""HDEE domains: disjoint, deterministic, non-empty splits; chains by difficulty; errors."""


import numpy as np
import pytest

# Small Debian domains only (fetched once into the cache folder) plus a portable one.
from conftest import DEBIAN_TEST_SOURCES as _DEBIAN_DOMAINS  # pylint: disable=g-bad-import-order

from lowcomm_jax import testing
from lowcomm_jax.data import debian, domains as data_domains, portable, tokenizer
from lowcomm_jax.hdee import domains

_PORTABLE_DOMAINS = ("licenses",)


def test_registry_has_three_chains_of_training_domains_and_held_out_ones():
  assert len(data_domains.TRAIN_DOMAINS) == 9
  assert len(data_domains.HELD_OUT_DOMAINS) >= 3
  assert not set(data_domains.TRAIN_DOMAINS) & set(data_domains.HELD_OUT_DOMAINS)
  for domain in data_domains.DOMAINS.values():
    assert domain.licence and domain.description
    assert domain.corpus in ("stdlib", "licenses", "docstrings") or (
        domain.corpus.split(":", 1)[1] in debian.SOURCES)


@pytest.mark.parametrize("name", _DEBIAN_DOMAINS + _PORTABLE_DOMAINS)
def test_splits_are_disjoint_deterministic_and_non_empty(cache_dir, name):
  splits = {s: data_domains.domain_documents(name, s, cache_dir) for s in data_domains.SPLITS}
  ids = {s: [doc_id for doc_id, _ in docs] for s, docs in splits.items()}
  assert all(ids.values()), {s: len(v) for s, v in ids.items()}
  assert not set(ids["train"]) & set(ids["validation"])
  assert not set(ids["train"]) & set(ids["test"])
  assert not set(ids["validation"]) & set(ids["test"])
  # Recomputed from scratch (caches dropped), the splits are the same.
  stream = data_domains.domain_bytes(name, "test", cache_dir)
  data_domains._splits.cache_clear()
  data_domains._domain_bytes.cache_clear()
  np.testing.assert_array_equal(data_domains.domain_bytes(name, "test", cache_dir), stream)
  again = {s: data_domains.domain_documents(name, s, cache_dir) for s in data_domains.SPLITS}
  assert again == splits
  # Roughly 80/10/10 by documents.
  total = sum(len(v) for v in ids.values())
  assert 0.7 < len(ids["train"]) / total < 0.9


def test_domain_bytes_are_the_documents_with_separators(cache_dir):
  docs = data_domains.domain_documents("bible_kjv", "validation", cache_dir)
  stream = data_domains.domain_bytes("bible_kjv", "validation", cache_dir)
  assert stream.dtype == np.uint8 and stream.ndim == 1
  assert int((stream == tokenizer.DOC_SEPARATOR).sum()) == len(docs)
  first = docs[0][1].encode("utf-8")
  assert stream[:len(first)].tobytes() == first
  sizes = data_domains.split_sizes("bible_kjv", cache_dir)
  assert sizes["validation"] == (len(docs), len(stream))


def test_few_documents_are_split_by_byte_ranges(monkeypatch):
  text = "".join(f"line {i}\n" for i in range(1000))
  monkeypatch.setitem(data_domains.DOMAINS, "one_book",
                      data_domains.Domain("one_book", "one_book", "a single long document", "none",
                                          held_out=True))
  monkeypatch.setitem(portable.CORPORA, "one_book", lambda: [("book", text)])
  data_domains._splits.cache_clear()
  data_domains._domain_bytes.cache_clear()
  try:
    parts = [data_domains.domain_documents("one_book", s) for s in data_domains.SPLITS]
  finally:
    data_domains._splits.cache_clear()
    data_domains._domain_bytes.cache_clear()
  assert [len(p) for p in parts] == [1, 1, 1]
  assert "".join(p[0][1] for p in parts) == text
  assert [len(p[0][1]) for p in parts] == [int(0.8 * len(text)),
                                           int(0.9 * len(text)) - int(0.8 * len(text)),
                                           len(text) - int(0.9 * len(text))]


def test_bigram_difficulty_matches_hand_values():
  # A stream that always alternates a, b is almost perfectly predictable...
  alternating = np.frombuffer(b"ab" * 5000, np.uint8)
  assert domains.bigram_bits_per_byte(alternating, alternating) < 0.01
  # ...and uniformly random bytes cost about 8 bits each (a little more: the
  # 65,536 pair counts overfit 3M training bytes slightly).
  noise = np.random.default_rng(0).integers(0, 256, 3_200_000).astype(np.uint8)
  assert 8.0 < domains.bigram_bits_per_byte(noise[:3_000_000], noise[3_000_000:]) < 8.05
  table = domains.bigram_log_prob_table(alternating, smoothing=0.0 + 1e-9)
  log_probs = domains.bigram_token_log_probs(table, np.frombuffer(b"abab", np.uint8)[None])
  assert log_probs.shape == (1, 4)
  # add-s counts: p(b|a) = (5000 + s)/(5000 + 256 s), p(a|b) = (4999 + s)/(4999 + 256 s): float64's
  # row sum of 256 terms and ≤ 3 roundings near 1 (add, quotient, log), then the float32 cast of
  # |log p| ≈ 5e-11
  s = 1e-9
  exact = np.log1p(-255 * s / (np.array([5000.0, 4999.0, 5000.0]) + 256 * s))
  bound = (
    testing.sum_error_bound(1.0, 256, np.float64)
    + testing.operation_error_bound(1.0, 3, np.float64)
    + testing.operation_error_bound(np.abs(exact), 1)
  )
  testing.assert_within(log_probs[0, 1:], exact, bound, "log p")


def test_measured_difficulty_of_real_domains(cache_dir):
  bible = domains.difficulty("bible_kjv", cache_dir)
  jargon = domains.difficulty("jargon", cache_dir)
  for score in (bible, jargon):
    assert 2.5 < score.bigram_bits_per_byte < 5.0
    assert 1.0 < score.zlib_bits_per_byte < 5.0
  # Scripture's small, repetitive vocabulary is easier than hacker slang.
  assert bible.bigram_bits_per_byte < jargon.bigram_bits_per_byte


def test_assign_chains_orders_by_difficulty():
  scores = {name: float(i) for i, name in enumerate(data_domains.TRAIN_DOMAINS)}
  chains = domains.assign_chains(scores)
  names = data_domains.TRAIN_DOMAINS
  assert chains == {"hard": (names[8], names[7], names[6]),
                    "moderate": (names[5], names[4], names[3]),
                    "easy": (names[2], names[1], names[0])}
  with pytest.raises(ValueError, match="no difficulty score"):
    domains.assign_chains({"stdlib": 1.0})
  with pytest.raises(ValueError, match="multiple of 3"):
    domains.assign_chains({"stdlib": 1.0, "austen": 2.0}, domains=("stdlib", "austen"))


def test_bad_input_errors(tmp_path):
  with pytest.raises(ValueError, match=r"unknown HDEE domain 'math'; allowed: stdlib, "):
    data_domains.domain_bytes("math", "train")
  with pytest.raises(ValueError, match=r"unknown split 'dev'; allowed: train, validation, test"):
    data_domains.domain_bytes("licenses", "dev")
  data_domains._splits.cache_clear()
  with pytest.raises(debian.NotFetchedError, match=r"fetch_corpora\.py --sources=gcide"):
    data_domains.domain_bytes("gcide", "train", tmp_path)


def test_measured_chains_match_the_reference():
  try:
    data_domains.fetch_domains(data_domains.TRAIN_DOMAINS)
  except debian.FetchError as error:
    pytest.skip(f"Debian corpora cannot be fetched here: {error}")
  assert domains.measured_chains() == domains.REFERENCE_CHAINS, (
      "the measured difficulty order changed (other package versions or Python "
      "version?); update REFERENCE_CHAINS and docs/data_and_hdee.md")
