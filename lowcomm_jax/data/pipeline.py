"""Deterministic grain pipelines over a token stream: train batches per replica shard, fixed eval
batches.

The token stream is cut into non-overlapping windows of `seq_len + 1` tokens
(inputs and shifted targets). Replica r of R owns the contiguous windows
[r·N/R, (r+1)·N/R), so shards are disjoint text, as in DiLoCo where every
worker has its own data. Each shard is a `grain.MapDataset`: shuffled with the
seed, repeated with a fresh order every epoch, batched. Batch k is
addressable by index, so the iterator state is the grain iterator's
`{"next_index": k}` and resuming is exact.
"""

from __future__ import annotations

import dataclasses
import math

import grain
import numpy as np

from lowcomm_jax.data import corpora, domains, files, tokenizer as tokenizer_lib


@dataclasses.dataclass(frozen=True)
class TokenSplits:
  """Train and eval token streams of one corpus, and the eval text's UTF-8 bytes per token."""

  corpus: str
  train: np.ndarray
  eval: np.ndarray
  bytes_per_token: float = 1.0

  def bits_per_byte(self, loss: float) -> float:
    """A loss in nats per token as bits per byte of the eval text, comparable across tokenizers."""
    return loss / math.log(2) / self.bytes_per_token


_SPLITS_CACHE: dict = {}
# Eval tokens decoded to count the eval text's bytes per token: enough for a stable average, few
# enough that a large pre-tokenized corpus's eval split is not decoded whole.
BYTES_COUNTED_TOKENS = 2_000_000


def splits_of(config) -> TokenSplits:
  """`load_splits` with a run config's data section."""
  d = config.data
  return load_splits(d.corpus, d.eval_permille, d.tokenizer, d.doc_separator, d.doc_chars)


def load_splits(corpus: str, eval_permille: int = 20, tokenizer: str = "bytes",
                doc_separator: str = "", doc_chars: int = 0) -> TokenSplits:
  """Tokenizes a corpus with `tokenizer` (`data.tokenizer`) and splits it into train and held-out
  eval text.

  Documents (cut at `doc_separator`, then into pieces of `doc_chars` characters, when given) go to
  the eval text by a hash of their id, `eval_permille` per mille of them. When that leaves either
  side empty (a corpus of one document, say) and for pre-tokenized `tokens:` corpora, the last
  `eval_permille` per mille of the token stream is held out instead. `bytes_per_token` is the eval
  text's UTF-8 bytes (a document separator counts one) over its tokens (its first
  BYTES_COUNTED_TOKENS tokens when longer): one for bytes.
  """
  if not 1 <= eval_permille <= 500:
    raise ValueError(f"data.eval_permille must be in [1, 500], got {eval_permille}")
  key = (corpus, eval_permille, tokenizer, doc_separator, doc_chars,
         corpora.corpus_identity(corpus, tokenizer) if files.is_file_corpus(corpus) else "")
  if key in _SPLITS_CACHE:
    return _SPLITS_CACHE[key]
  tok = tokenizer_lib.load_tokenizer(tokenizer)
  if corpus.startswith("domain:"):
    # A domain brings its own document-level splits; its validation split is the eval text.
    name = corpus.split(":", 1)[1]
    train, held = (np.array(domains.domain_bytes(name, "train")),
                   np.array(domains.domain_bytes(name, "validation")))
  elif corpus.startswith("tokens:"):
    ids, meta = files.read_tokens(corpus)
    check_token_vocab(corpus, meta, tok)
    train, held = tail_split(ids, eval_permille)
  else:
    docs = list(files.cut(corpora.load_documents(corpus), doc_separator, doc_chars))
    train = tok.encode_documents(t for d,
                                 t in docs if not corpora.is_eval_document(d, eval_permille))
    held = tok.encode_documents(t for d, t in docs if corpora.is_eval_document(d, eval_permille))
    if not len(held) or not len(train):  # too few documents for a split by documents
      train, held = tail_split(tok.encode_documents(t for _, t in docs), eval_permille)
  counted = held[:BYTES_COUNTED_TOKENS]
  _SPLITS_CACHE[key] = TokenSplits(corpus, train, held,
                                   tok.count_bytes(counted) / max(len(counted), 1))
  return _SPLITS_CACHE[key]


def tail_split(stream: np.ndarray, eval_permille: int) -> tuple[np.ndarray, np.ndarray]:
  """(train, eval): the last `eval_permille` per mille of a token stream held out (one token at
  least)."""
  cut = len(stream) - max(len(stream) * eval_permille // 1000, 1)
  return stream[:cut], stream[cut:]


def check_token_vocab(corpus: str, meta: dict, tok) -> None:
  """Pre-tokenized ids must come from `data.tokenizer`: the tokenizer their metadata names by
  SHA-256 (prepare_data.py records it), or, in metadata without one, a vocabulary no larger."""
  recorded = meta.get("tokenizer_sha256")
  if recorded and recorded != tokenizer_lib.sha256_of(tok):
    spec = getattr(tok, "spec", tok)
    raise ValueError(f"data.corpus={corpus!r} was tokenized by {meta.get('tokenizer', '?')!r} "
                     f"(sha256 {recorded[:12]}), but data.tokenizer={spec!r} is another "
                     f"tokenizer (sha256 {tokenizer_lib.sha256_of(tok)[:12]}); set "
                     "data.tokenizer to the one that prepared it, or prepare the corpus again")
  if int(meta["vocab_size"]) > tok.vocab_size:
    raise ValueError(f"data.tokenizer={getattr(tok, 'spec', tok)!r} has {tok.vocab_size} tokens "
                     f"but data.corpus={corpus!r} holds ids of a vocabulary "
                     f"of {meta['vocab_size']} (its metadata names "
                     f"tokenizer {meta.get('tokenizer', '?')!r}); set data.tokenizer to that "
                     f"tokenizer")


class _Windows:
  """Random-access source: window i = tokens[start + i·T : start + i·T + T + 1]."""

  def __init__(self, tokens: np.ndarray, seq_len: int, first: int, count: int):
    self._tokens, self._seq_len, self._first, self._count = tokens, seq_len, first, count

  def __len__(self):
    return self._count

  def __getitem__(self, i):
    start = (self._first + int(i)) * self._seq_len
    return self._tokens[start:start + self._seq_len + 1].astype(np.int32)


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
  return (len(tokens) - 1) // seq_len


def shard_range(total: int, shard_index: int, num_shards: int) -> tuple[int, int]:
  """[first, last) windows of a shard: contiguous, disjoint, covering all but a remainder <
  num_shards."""
  per_shard = total // num_shards
  return shard_index * per_shard, (shard_index + 1) * per_shard


def train_dataset(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                  shard_index: int = 0, num_shards: int = 1) -> grain.MapDataset:
  """Infinite, shuffled batches [batch_size, seq_len + 1] of one shard."""
  first, last = shard_range(num_windows(tokens, seq_len), shard_index, num_shards)
  if last - first < batch_size:
    raise ValueError(f"data.batch_size={batch_size} with data.seq_len={seq_len}: "
                     f"shard {shard_index} of {num_shards} has only {last - first} windows "
                     f"of {seq_len + 1} tokens; data.batch_size must be <= {last - first}, or "
                     f"data.seq_len at "
                     f"most {max((len(tokens) - 1) // (num_shards * batch_size), 1)}")
  source = _Windows(tokens, seq_len, first, last - first)
  ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
  return ds.batch(batch_size, drop_remainder=True, batch_fn=np.stack)


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int) -> np.ndarray:
  """Up to `max_batches` batches of held-out windows spread evenly over the eval text: [n, B, T +
  1]."""
  total = num_windows(tokens, seq_len)
  n = min(total // batch_size, max_batches)
  if n < 1:
    fixes = [f"eval.batch_size must be <= {total}"] if total else []
    fixes.append(f"data.seq_len at most {max((len(tokens) - 1) // batch_size, 1)}")
    raise ValueError(f"eval.batch_size={batch_size} with data.seq_len={seq_len}: the eval text has "
                     f"{len(tokens)} tokens, {total} windows of {seq_len + 1}, too few for one "
                     f"batch; {', or '.join(fixes)} (or raise data.eval_permille)")
  src = _Windows(tokens, seq_len, 0, total)
  # Evenly spaced windows sample every part of the held-out text, not just its first documents.
  picks = np.linspace(0, total - 1, n * batch_size).astype(np.int64)
  return np.stack([src[i] for i in picks]).reshape(n, batch_size, seq_len + 1)
