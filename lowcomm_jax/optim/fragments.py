"""Fragments: disjoint pieces of the parameter tree that Streaming DiLoCo syncs on their own
schedule.

A `Fragment` names, for each parameter path ("blocks/attn/wq"), either the
whole array or a strided slice of its leading layer axis. Stacked blocks make
the paper's patterns (docs/algorithms.md §1.2(a)) static slices:
- sequential: fragment p holds blocks [p·L/P, (p+1)·L/P);
- strided: fragment p holds blocks p, p+P, p+2P, ...
Parameters outside the blocks (embedding, final norm, head) form their own
fragment by default (`non_block="own"`, as MaxText) or are folded into
fragment 0 (`non_block="fold"`). Every parameter is covered exactly once.

A fragment's values are a sub-tree of the parameter tree (`extract`): the same nested dicts and
keys, the fragment's arrays (whole, or their layer slice [L/P, ...]) at its paths, and
`optax.MaskedNode()` everywhere else, as in `optax.masked`. So each piece of per-fragment state
(outer optimizer state, in-flight outer gradient, error-feedback residual) sits under the
parameters' own path keys: it takes their shardings (`lowcomm_jax.sharding.state_specs`) and
`optax.tree_map_params` reaches it.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import optax

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


def extract(fragment: Fragment, tree):
  """The fragment's sub-tree of `tree` (the parameters or anything shaped like them).

  `tree`'s structure, with the fragment's arrays (whole leaves or static layer slices) at its paths
  and `optax.MaskedNode()` at every other leaf. A tree with no leaves (optax's parameter
  placeholder in `optax.tree_map_params`) is its own sub-tree.
  """
  slices = dict(fragment.leaves)

  def take(key_path, leaf):
    name = path_name(key_path)
    if name not in slices:
      return optax.MaskedNode()
    return leaf if slices[name] is None else leaf[slice(*slices[name])]

  return jax.tree_util.tree_map_with_path(take, tree)


def insert(fragment: Fragment, tree, sub_tree):
  """`tree` with the fragment's arrays replaced by those of `sub_tree` (as `extract` gives)."""
  slices = dict(fragment.leaves)

  def put(key_path, leaf, value):
    name = path_name(key_path)
    if name not in slices:
      return leaf
    return value if slices[name] is None else leaf.at[slice(*slices[name])].set(value)

  return jax.tree_util.tree_map_with_path(put, tree, sub_tree)


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
    raise ValueError(f"outer.fragment_pattern must be 'strided' or 'sequential', got {pattern!r}")
  if non_block not in ("own", "fold"):
    raise ValueError(f"outer.non_block_fragment must be 'own' or 'fold', got {non_block!r}")
  if non_block == "own" and not other_paths:
    raise ValueError("outer.non_block_fragment='own' adds a fragment of the parameters outside "
                     "'blocks/...', but this tree has only block leaves; use "
                     "non_block_fragment=\"fold\"")
  if num_fragments < 1 or num_layers % num_fragments:
    raise ValueError(f"outer.num_fragments={num_fragments} must divide the model's {num_layers} "
                     f"layers")
  per = num_layers // num_fragments
  fragments = []
  for p in range(num_fragments):
    layer_slice = (
      (p, num_layers, num_fragments) if pattern == "strided" else (p * per, (p + 1) * per, 1)
    )
    leaves = tuple((path, layer_slice) for path in block_paths)
    if non_block == "fold" and p == 0:
      leaves += tuple((path, None) for path in other_paths)
    fragments.append(Fragment(f"blocks {pattern} {p}", leaves))
  if non_block == "own" and other_paths:
    fragments.append(Fragment("non-block", tuple((path, None) for path in other_paths)))
  return tuple(fragments)


def check_cover(fragments: tuple[Fragment, ...], params) -> None:
  """Every parameter element belongs to exactly one fragment, or a ValueError lists what does
  not."""
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


Rules = tuple[tuple[str, int], ...]


def parse_rules(text: str) -> Rules:
  """The regex table of a config string: "blocks/attn/.*:0,blocks/.*:1,.*:2".

  Comma-separated `regex:index` entries, split at each entry's last ':' (so a regex may hold ':'
  but not ','). Raises one ValueError naming `outer.fragment_rules` for a malformed entry, a regex
  that does not compile, or indices that are not 0, 1, ..., F−1.
  """
  rules = []
  for entry in (e.strip() for e in str(text).split(",")):
    pattern, sep, index = entry.rpartition(":")
    if not sep or not pattern or not index.strip().isdigit():
      raise ValueError(f"outer.fragment_rules must be comma-separated 'regex:index' entries "
                       f"(index an integer >= 0), e.g. 'blocks/.*:0,.*:1'; got entry {entry!r} "
                       f"in {text!r}")
    try:
      re.compile(pattern)
    except re.error as error:
      raise ValueError(f"outer.fragment_rules: {pattern!r} is not a regular expression "
                       f"({error})") from None
    rules.append((pattern, int(index)))
  check_rule_indices(rules)
  return tuple(rules)


def check_rule_indices(rules) -> int:
  """The number of fragments F of a rule table whose indices are exactly 0, ..., F−1 (else a
  ValueError)."""
  indices = sorted({int(index) for _, index in rules})
  if not indices or indices != list(range(len(indices))):
    raise ValueError(f"outer.fragment_rules: fragment indices must be 0, 1, ..., F-1 with none "
                     f"skipped, got {indices}")
  return len(indices)


def rule_fragments(params, rules) -> tuple[Fragment, ...]:
  """Fragments from a regex table, big_vision style: `[(regex, fragment_index), ...]`.

  Each parameter path ("blocks/attn/wq") goes, whole, to the fragment of the first rule whose regex
  matches it (`re.fullmatch`). A rule that matches no parameter, or a parameter that no rule
  matches, is an error naming them. `streaming_diloco(..., fragments=rules)` takes the table itself
  (a schedule of `max(index) + 1` rows); from a config, `--config.outer.fragment_rules`
  (`parse_rules`).
  """
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
    raise ValueError(f"outer.fragment_rules: the rules {idle} match no parameter; every rule must "
                     "match at least one parameter path")
  if unmatched:
    raise ValueError(f"outer.fragment_rules must cover every parameter, these match no rule: "
                     f"{unmatched}; a last rule '.*:<index>' takes the rest")
  count = max(leaves) + 1
  missing = [i for i in range(count) if i not in leaves]
  if missing:
    raise ValueError(f"outer.fragment_rules give no parameter to fragments {missing}; every index "
                     "0..F-1 must get at least one")
  return tuple(Fragment(f"rule fragment {i}", tuple(leaves[i])) for i in range(count))
