"""Checks of user input that name the option and its allowed values: one ValueError, before compute.

The config's validation (`train.validation`), each algorithm's config check (`train.algorithms`)
and the public constructors (`lowcomm_jax.diloco`, `noloco`, `optim.make_schedule`,
`sim.utilization.Method`) share these, so an option is refused with the same words wherever it is
given. Standard library only: importing it costs nothing.
"""

from __future__ import annotations

import math
import numbers


def require(cond: bool, option: str, allowed: str, value) -> None:
  """Raises "`option` must be `allowed`, got `value`" unless `cond`."""
  if not cond:
    raise ValueError(f"{option} must be {allowed}, got {value!r}")


def _at(c, key: str):
  section, _, name = key.rpartition(".")
  return (c[section] if section else c)[name]


def number(c, key: str, low: float, high: float = math.inf, *, low_open: bool = False,
           high_open: bool = True) -> None:
  """Requires the (finite) number at dotted `key` of config `c` to lie in the interval."""
  value = _at(c, key)
  left, right = "(" if low_open else "[", ")" if high_open else "]"
  finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  inside = finite and (value > low if low_open else value >= low) and (
      value < high if high_open else value <= high)
  if high == math.inf:
    allowed = f"a finite number {'>' if low_open else '>='} {low:g}"
  else:
    allowed = f"a number in {left}{low:g}, {high:g}{right}"
  require(inside, key, allowed, value)


def integer(c, key: str, low: int, high: int | None = None, note: str = "") -> None:
  """Requires an int at dotted `key` of config `c` in [low, high) (no upper bound when None)."""
  value = _at(c, key)
  ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (
      high is None or value < high)
  allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high})"
  require(ok, key, allowed + note, value)


def _is_whole(value) -> bool:
  """An int, or a float with an integral value (4.0); never a bool, a string or inf/NaN."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    return False
  return math.isfinite(value) and value == int(value)


def sync_every(value, option: str = "outer.sync_every", *, num_steps: int | None = None,
               num_fragments: int = 1) -> int:
  """H, the inner steps between two syncs: THE check of every `sync_every`; returns it as an int.

  Args:
    value: the H given.
    option: the option's name in the message (`outer.sync_every`, `noloco.sync_every`, ...).
    num_steps: the run's length when known: H > num_steps would never sync.
    num_fragments: P of a staggered Streaming DiLoCo schedule (counting the non-block fragment):
      fragment p syncs at offset (p+1)·H/P, so P must divide H. 1 when no such constraint holds.
  """
  if not _is_whole(value) or value < 1:
    raise ValueError(f"{option} (H) must be an integer >= 1, got {value!r}")
  h = int(value)
  if num_steps is not None and h > num_steps:
    raise ValueError(f"{option} (H) must be an integer in [1, num_steps={num_steps}] (H > "
                     f"num_steps: no outer step would ever happen), got {value!r}")
  if num_fragments > 1 and h % num_fragments:
    below, above = h - h % num_fragments, h - h % num_fragments + num_fragments
    nearest = f"{below} or {above}" if below else f"{above}"
    raise ValueError(f"{option} (H={h}) must be divisible by the number of fragments "
                     f"(P={num_fragments}, counting the non-block fragment) for a staggered "
                     f"schedule: a multiple of {num_fragments} such as {nearest}")
  return h
