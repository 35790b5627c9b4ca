"""Byte-level tokenizer: UTF-8 bytes are the tokens (vocabulary 256), no dependency, no training."""

from __future__ import annotations

import numpy as np

DOC_SEPARATOR = 0  # NUL never occurs in the text corpora, so it marks document boundaries.


class ByteTokenizer:
  """Encodes text to its UTF-8 bytes and back."""

  vocab_size = 256

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

  def decode(self, tokens) -> str:
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

  def encode_documents(self, texts) -> np.ndarray:
    """One token stream: each document followed by DOC_SEPARATOR."""
    parts = []
    for text in texts:
      parts.append(self.encode(text.replace("\x00", "")))
      parts.append(np.array([DOC_SEPARATOR], np.uint8))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint8)

  def files(self) -> list:
    """Files that define the tokenizer (to copy next to an exported model): none for bytes."""
    return []


TOKENIZERS = ("bytes",)


def load_tokenizer(spec: str = "bytes") -> ByteTokenizer:
  """The tokenizer `data.tokenizer` names: "bytes" (UTF-8 bytes, vocabulary 256)."""
  if spec != "bytes":
    raise ValueError(f"data.tokenizer must be one of {TOKENIZERS}, got {spec!r}")
  return ByteTokenizer()
