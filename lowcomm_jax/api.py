"""The optax-style transforms as `lowcomm_jax.diloco`, `streaming_diloco`, `sparseloco` and
`noloco` give them: `lowcomm_jax.optim`'s functions, whose refusals name the function's arguments.

The checks those functions share with the Trainer name the config keys a run sets (the Trainer
builds its algorithm through `lowcomm_jax.optim`); called from Python, the same refusal names the
argument instead: `sync_every (H) must be an integer >= 1, got 0`, not `outer.sync_every ...`.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

from lowcomm_jax import optim

_SCHEDULE = ("sync_every", "overlap_steps", "merge_alpha", "overlap_anchor")


def _named(section: str, arguments: tuple[str, ...]) -> dict:
  """{"section.argument": "argument"}: the config keys that are these arguments."""
  return {f"{section}.{a}": a for a in arguments}


def _naming_arguments(fn: Callable, keys: dict) -> Callable:
  """`fn`, and the `init`, `init_replicated` and `fragments` of the transformation it returns,
  whose ValueErrors name `keys`' values (the arguments) where they named its keys (config keys)."""
  longest_first = sorted(keys, key=len, reverse=True)
  pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, longest_first)) + r")(?!\w)")

  def naming(call: Callable) -> Callable:
    @functools.wraps(call)
    def wrapped(*args, **kwargs):
      try:
        return call(*args, **kwargs)
      except ValueError as error:
        message = pattern.sub(lambda m: keys[m.group(1)], str(error))
        if message == str(error):
          raise
        raise ValueError(message) from None
    return wrapped

  @functools.wraps(fn)
  def make(*args, **kwargs):
    tx = naming(fn)(*args, **kwargs)
    # a fragment rule is checked when `init` first sees the parameters
    for method in ("init", "init_replicated", "fragments"):
      if hasattr(tx, method):
        setattr(tx, method, naming(getattr(tx, method)))
    return tx
  return make


_DILOCO = _SCHEDULE + ("error_feedback", "codec_kernels", "codec", "eager")
_FRAGMENTS = {"outer.num_fragments": "fragments", "outer.fragment_rules": "fragments"}
streaming_diloco = _naming_arguments(optim.streaming_diloco, _named("outer", _DILOCO) | _FRAGMENTS)
diloco = _naming_arguments(optim.diloco, _named("outer", _DILOCO))
sparseloco = _naming_arguments(
    optim.sparseloco,
    _named("outer", _SCHEDULE) | _FRAGMENTS | _named(
        "sparseloco", ("top_k", "chunk_size", "bits", "feedback_decay", "outer_learning_rate")))
noloco = _naming_arguments(optim.noloco, _named(
    "noloco", ("sync_every", "group_size", "momentum", "learning_rate", "gamma", "codec")))
outer_nesterov = optim.outer_nesterov
