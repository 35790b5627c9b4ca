"""The data pipeline: real text, deterministic, disjoint replica shards, held-out eval documents."""

import numpy as np
import pytest

from lowcomm_jax.data import corpora, pipeline, stats
from lowcomm_jax.data.tokenizer import ByteTokenizer


def test_tokenizer_round_trip():
  tok = ByteTokenizer()
  text = "déjà vu — def f(x):\n    return x"
  assert tok.decode(tok.encode(text)) == text
  stream = tok.encode_documents(["ab", "c"])
  assert stream.tolist() == [97, 98, 0, 99, 0]


@pytest.mark.parametrize("corpus", ["stdlib", "licenses"])
def test_shipped_corpora_are_real_text(corpus):
  docs = corpora.load_documents(corpus)
  assert len(docs) > 500
  size = sum(len(t) for _, t in docs)
  assert size > 3_000_000
  if corpus == "stdlib":
    ids = dict(docs)
    assert "def " in ids["json/decoder.py"] and "JSONDecodeError" in ids["json/decoder.py"]
  else:
    assert "MIT" in dict(docs) and "Permission is hereby granted" in dict(docs)["MIT"]


def test_eval_documents_are_held_out():
  docs = corpora.load_documents("stdlib")
  held = {d for d, _ in docs if corpora.is_eval_document(d, 20)}
  train = {d for d, _ in docs if not corpora.is_eval_document(d, 20)}
  assert held and train and not held & train
  assert 0.005 < len(held) / len(docs) < 0.05
  splits = pipeline.load_splits("stdlib", 20)
  tok = ByteTokenizer()
  expected_eval = tok.encode_documents(t for d, t in docs if d in held)
  np.testing.assert_array_equal(splits.eval, expected_eval)
  assert len(splits.train) + len(splits.eval) == sum(len(tok.encode(t.replace("\x00", ""))) + 1
                                                     for _, t in docs)


def _window_ids(batch, seq_len):
  # The synthetic stream is arange, so a window's first token names it.
  return set((batch[:, 0] // seq_len).tolist())


def test_train_batches_are_deterministic_for_a_seed_and_resume_from_iterator_state():
  tokens = np.arange(10_000, dtype=np.int32)
  a = pipeline.train_dataset(tokens, 16, 8, seed=3)
  b = pipeline.train_dataset(tokens, 16, 8, seed=3)
  c = pipeline.train_dataset(tokens, 16, 8, seed=4)
  first = [a[i] for i in range(5)]
  for i in range(5):
    np.testing.assert_array_equal(first[i], b[i])
  assert any(not np.array_equal(first[i], c[i]) for i in range(5))
  # Windows are consecutive text: inputs and targets overlap by one token.
  np.testing.assert_array_equal(first[0][:, 1:] - first[0][:, :-1], np.ones((8, 16)))
  it = iter(a)
  for _ in range(3):
    next(it)
  state = it.get_state()
  resumed = iter(pipeline.train_dataset(tokens, 16, 8, seed=3))
  resumed.set_state(state)
  np.testing.assert_array_equal(next(resumed), first[3])


def test_replica_shards_are_disjoint_and_each_covers_its_own_range():
  tokens = np.arange(4_097, dtype=np.int32)  # 256 windows of 16 tokens
  seen = []
  for shard in range(4):
    ds = pipeline.train_dataset(tokens, 16, 4, seed=0, shard_index=shard, num_shards=4)
    ids = set().union(*(_window_ids(ds[i], 16) for i in range(16)))  # one epoch: 64 windows
    first, last = pipeline.shard_range(256, shard, 4)
    assert ids == set(range(first, last))
    seen.append(ids)
  for i in range(4):
    for j in range(i + 1, 4):
      assert not seen[i] & seen[j]


def test_epochs_reshuffle():
  tokens = np.arange(1_025, dtype=np.int32)  # 64 windows
  ds = pipeline.train_dataset(tokens, 16, 8, seed=0)
  epoch0 = np.concatenate([ds[i][:, 0] for i in range(8)])
  epoch1 = np.concatenate([ds[i][:, 0] for i in range(8, 16)])
  assert sorted(epoch0) == sorted(epoch1) and not np.array_equal(epoch0, epoch1)


def test_reference_entropies():
  uniform = np.tile(np.arange(4, dtype=np.uint8), 1000)
  assert stats.unigram_entropy(uniform) == pytest.approx(np.log(4))
  # A deterministic cycle is perfectly predictable from the previous byte.
  assert stats.bigram_cross_entropy(uniform, uniform) < 0.01
  rng = np.random.default_rng(0)
  noise = rng.integers(0, 4, 100_000).astype(np.uint8)
  assert stats.bigram_cross_entropy(noise, noise[:20_000]) == pytest.approx(np.log(4), abs=0.01)
