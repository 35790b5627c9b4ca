"""Fragments: disjoint pieces of the parameter tree that Streaming DiLoCo syncs on their own schedule.

A `Fragment` names, for each parameter path ("blocks/attn/wq"), either the
whole array or a strided slice of its leading layer axis. Stacked blocks make
the paper's patterns (docs/algorithms.md §1.2(a)) static slices:
- sequential: fragment p holds blocks [p·L/P, (p+1)·L/P);
- strided: fragment p holds blocks p, p+P, p+2P, ...
Parameters outside the blocks (embedding, final norm, head) form their own
fragment by default (`non_block="own"`, as MaxText) or are folded into
fragment 0 (`non_block="fold"`). Every parameter is covered exactly once.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from lowcomm_jax.models.llama import path_name

LayerSlice = tuple[int, int, int]  # (start, stop, step) along the leading layer axis
BLOCKS_PREFIX = "blocks/"


@dataclasses.dataclass(frozen=True)
class Fragment:
  """One fragment: parameter path -> None (the whole array) or a layer slice."""

  name: str
  leaves: tuple[tuple[str, LayerSlice | None], ...]

  def num_elements(self, params) -> int:
    flat = flatten(params)
    return sum(int(np.prod(_sliced_shape(flat[p].shape, s))) for p, s in self.leaves)


def _sliced_shape(shape, layer_slice):
  if layer_slice is None:
    return shape
  return (len(range(*layer_slice)),) + tuple(shape[1:])


def flatten(params) -> dict:
  """{path: array} of a pure-dict parameter tree."""
  return {path_name(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def extract(fragment: Fragment, params) -> list:
  """The fragment's arrays (whole leaves or static layer slices), in the fragment's order."""
  flat = flatten(params)
  return [flat[p] if s is None else flat[p][slice(*s)] for p, s in fragment.leaves]


def insert(fragment: Fragment, params, values: list):
  """`params` with the fragment's arrays replaced by `values`."""
  updates = dict(zip((p for p, _ in fragment.leaves), zip((s for _, s in fragment.leaves), values)))

  def replace(key_path, leaf):
    name = path_name(key_path)
    if name not in updates:
      return leaf
    layer_slice, value = updates[name]
    return value if layer_slice is None else leaf.at[slice(*layer_slice)].set(value)

  return jax.tree_util.tree_map_with_path(replace, params)


def whole_model(params) -> tuple[Fragment, ...]:
  """One fragment holding every parameter (vanilla DiLoCo)."""
  return (Fragment("all", tuple((p, None) for p in flatten(params))),)


def layer_fragments(params, num_fragments: int, pattern: str = "strided",
                    non_block: str = "own") -> tuple[Fragment, ...]:
  """P fragments over the stacked blocks, plus the non-block parameters as `non_block` says.

  Args:
    params: a pure-dict parameter tree whose "blocks/..." leaves have a leading layer axis.
    num_fragments: P, the number of block fragments; must divide the number of layers L.
    pattern: "strided" (blocks p, p+P, ...) or "sequential" (blocks [p·L/P, (p+1)·L/P)).
    non_block: "own" (an extra fragment, synced like the others) or "fold" (into fragment 0).
  """
  flat = flatten(params)
  block_paths = [p for p in flat if p.startswith(BLOCKS_PREFIX)]
  other_paths = [p for p in flat if not p.startswith(BLOCKS_PREFIX)]
  if not block_paths:
    raise ValueError("fragments: the parameter tree has no 'blocks/...' leaves to split by layer")
  num_layers = flat[block_paths[0]].shape[0]
  if pattern not in ("strided", "sequential"):
    raise ValueError(f"diloco.fragment_pattern must be 'strided' or 'sequential', got {pattern!r}")
  if non_block not in ("own", "fold"):
    raise ValueError(f"diloco.non_block_fragment must be 'own' or 'fold', got {non_block!r}")
  if num_fragments < 1 or num_layers % num_fragments:
    raise ValueError(f"diloco.num_fragments={num_fragments} must divide the model's {num_layers} layers")
  per = num_layers // num_fragments
  fragments = []
  for p in range(num_fragments):
    layer_slice = (p, num_layers, num_fragments) if pattern == "strided" else (p * per, (p + 1) * per, 1)
    leaves = tuple((path, layer_slice) for path in block_paths)
    if non_block == "fold" and p == 0:
      leaves += tuple((path, None) for path in other_paths)
    fragments.append(Fragment(f"blocks {pattern} {p}", leaves))
  if non_block == "own" and other_paths:
    fragments.append(Fragment("non-block", tuple((path, None) for path in other_paths)))
  return tuple(fragments)


def check_cover(fragments: tuple[Fragment, ...], params) -> None:
  """Every parameter element belongs to exactly one fragment, or a ValueError lists what does not."""
  flat = flatten(params)
  counts = {p: np.zeros(v.shape[:1] if v.ndim else (1,), int) for p, v in flat.items()}
  for f in fragments:
    for p, s in f.leaves:
      if p not in counts:
        raise ValueError(f"fragment {f.name!r} names {p!r}, which is not a parameter")
      if s is None:
        counts[p] += 1
      else:
        counts[p][slice(*s)] += 1
  uncovered = sorted(p for p, c in counts.items() if (c == 0).any())
  twice = sorted(p for p, c in counts.items() if (c > 1).any())
  if uncovered or twice:
    raise ValueError(f"fragments must cover every parameter exactly once; uncovered: {uncovered}, "
                     f"covered more than once: {twice}")


def rule_fragments(params, rules) -> tuple[Fragment, ...]:
  """Fragments from a regex table, big_vision style: `[(regex, fragment_index), ...]`.

  Each parameter path ("blocks/attn/wq") goes, whole, to the fragment of the first rule whose regex
  matches it (`re.fullmatch`). A rule that matches no parameter, or a parameter that no rule
  matches, is an error naming them. Usable as `streaming_diloco(..., fragments=lambda p:
  rule_fragments(p, rules))` with a schedule of `max(index) + 1` rows.
  """
  import re  # pylint: disable=g-import-not-at-top
  compiled = [(re.compile(pattern), int(index)) for pattern, index in rules]
  leaves: dict[int, list] = {}
  used = [False] * len(compiled)
  unmatched = []
  for path in flatten(params):
    for i, (regex, index) in enumerate(compiled):
      if regex.fullmatch(path):
        leaves.setdefault(index, []).append((path, None))
        used[i] = True
        break
    else:
      unmatched.append(path)
  idle = [rules[i][0] for i, u in enumerate(used) if not u]
  if idle:
    raise ValueError(f"diloco fragment rules {idle} match no parameter")
  if unmatched:
    raise ValueError(f"diloco fragment rules leave parameters uncovered: {unmatched}")
  count = max(leaves) + 1
  missing = [i for i in range(count) if i not in leaves]
  if missing:
    raise ValueError(f"diloco fragment rules give no parameter to fragments {missing}")
  return tuple(Fragment(f"rule fragment {i}", tuple(leaves[i])) for i in range(count))
