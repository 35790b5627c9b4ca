"""HDEE experts at inference: load a finished run as an `Expert`, average experts' parameters, and
score text with per-token log-probs (cached on disk per expert and domain).

Example:
  expert = scoring.load_expert(workdir)                        # a finished Trainer run
  log_probs_BxT = scoring.token_log_probs(expert, windows_BxT1)
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowcomm_jax.data import domains as domains_lib, pipeline
from lowcomm_jax.models import llama
from lowcomm_jax.train import checkpoint


@dataclasses.dataclass(frozen=True)
class Expert:
  """A trained model ready for inference.

  Attributes:
    name: a label (the chain, or "parameter average").
    graphdef: the model's `nnx.GraphDef`.
    params: its parameters (a pure dict).
  """

  name: str
  graphdef: Any
  params: Any


def load_expert(workdir: str | pathlib.Path, name: str = "") -> Expert:
  """The final parameters of a finished run."""
  workdir = pathlib.Path(workdir).absolute()
  if not (workdir / "summary.json").exists():
    raise ValueError(f"{workdir} holds no finished run (no summary.json)")
  model_cfg, params = checkpoint.read_eval_params(workdir)
  graphdef = nnx.split(nnx.eval_shape(lambda: llama.Decoder(model_cfg, nnx.Rngs(0))), nnx.Param)[0]
  return Expert(name or workdir.parent.name, graphdef, params)


def average_parameters(experts: Sequence[Expert], name: str = "parameter average") -> Expert:
  """One model whose parameters are the mean of the experts' (they must share a shape).

  Raises:
    ValueError: no experts, or experts of different shapes (sizes S/M/L).
  """
  if not experts:
    raise ValueError("average_parameters needs at least one expert")
  shapes = [jax.tree.map(jnp.shape, e.params) for e in experts]
  if any(s != shapes[0] for s in shapes[1:]):
    raise ValueError("average_parameters needs experts of one size; got "
                     f"{[e.name for e in experts]} with different parameter shapes")
  params = jax.tree.map(lambda *leaves: sum(leaves) / len(leaves), *[e.params for e in experts])
  return Expert(name, experts[0].graphdef, params)


@functools.partial(jax.jit, static_argnums=0)
def _token_log_probs(graphdef, params, windows_BxT1):
  logits_BxTxV = nnx.merge(graphdef, params)(windows_BxT1[:, :-1])
  log_probs_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(log_probs_BxTxV, windows_BxT1[:, 1:, None], axis=-1)[..., 0]


def token_log_probs(expert: Expert, windows_BxT1: np.ndarray, batch_size: int = 32) -> np.ndarray:
  """``log p(x_t | x_<t)`` of each next token of windows [B, T + 1]: a [B, T] float32 array.

  The layout `lowcomm_jax.hdee.ensemble` mixes: stack experts on a new axis 0.
  """
  windows_BxT1 = np.asarray(windows_BxT1, np.int32)
  if windows_BxT1.ndim != 2 or windows_BxT1.shape[1] < 2:
    raise ValueError(f"windows_BxT1 must be [batch, time + 1] with time >= 1, "
                     f"got shape {windows_BxT1.shape}")
  return np.concatenate([np.asarray(_token_log_probs(expert.graphdef, expert.params,
                                                     windows_BxT1[i:i + batch_size]))
                         for i in range(0, len(windows_BxT1), batch_size)])


def document_log_probs(expert: Expert, tokens: np.ndarray, window: int) -> np.ndarray:
  """Per-token log-probs [len(tokens) - 1] of a long 1-D token stream, read `window` tokens at a
  time.

  Consecutive windows overlap by one token, so every token after the first is
  scored once; the context restarts at each window (the model's positions are
  limited to its ``max_seq_len``).
  """
  tokens = np.asarray(tokens, np.int32)
  if tokens.ndim != 1 or len(tokens) < window + 1:
    raise ValueError(f"tokens must be 1-D with at least window + 1 = {window + 1} entries, "
                     f"got shape {tokens.shape}")
  count = (len(tokens) - 1) // window
  windows_BxT1 = np.stack([tokens[i * window:(i + 1) * window + 1] for i in range(count)])
  return token_log_probs(expert, windows_BxT1).reshape(-1)


def domain_windows(name: str, split: str, seq_len: int, count: int) -> np.ndarray:
  """`count` windows [count, seq_len + 1] spread evenly over one split of a domain, in text
  order."""
  if count < 1:
    raise ValueError(f"count must be >= 1, got {count}")
  tokens = np.asarray(domains_lib.domain_bytes(name, split))
  return pipeline.eval_batches(tokens, seq_len, count, 1)[0]


def expert_log_probs(expert: Expert, names: Sequence[str], seq_len: int, validation_count: int,
                     test_count: int) -> dict[str, dict[str, np.ndarray]]:
  """``{domain: {"validation": [N, T], "test": [B, T]}}`` per-token log-probs of one expert."""
  return {name: {split: token_log_probs(expert, domain_windows(name, split, seq_len, count))
                 for split, count in (("validation", validation_count), ("test", test_count))}
          for name in names}


def save_log_probs(path: pathlib.Path, log_probs: Mapping[str, Mapping[str, np.ndarray]]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  arrays = {f"{name}/{split}": value for name, splits in log_probs.items()
            for split, value in splits.items()}
  tmp = path.with_suffix(".tmp.npz")
  np.savez(tmp, **arrays)
  tmp.replace(path)  # Atomic: an interrupted write never leaves a half file to be trusted.


def load_log_probs(path: pathlib.Path) -> dict[str, dict[str, np.ndarray]]:
  out: dict[str, dict[str, np.ndarray]] = {}
  with np.load(path) as arrays:
    for key in arrays.files:
      name, split = key.split("/")
      out.setdefault(name, {})[split] = arrays[key]
  return out


def cached_log_probs(path: pathlib.Path, make_expert: Callable[[], Expert], names: Sequence[str],
                     seq_len: int, validation_count: int, test_count: int
                     ) -> dict[str, dict[str, np.ndarray]]:
  """`expert_log_probs`, read from `path` when an earlier run already wrote them for these
  windows."""
  if path.exists():
    cached = load_log_probs(path)
    if set(names) <= set(cached) and all(
        cached[n]["validation"].shape == (validation_count, seq_len)
        and cached[n]["test"].shape == (test_count, seq_len) for n in names):
      return {n: cached[n] for n in names}
  log_probs = expert_log_probs(make_expert(), names, seq_len, validation_count, test_count)
  save_log_probs(path, log_probs)
  return log_probs
