"""summary.json: what a finished run reports, as strict JSON (a NaN or inf becomes null, with why)."""

from __future__ import annotations

import json
import math
import pathlib


def strict_json(value, path: str = "", replaced: dict | None = None):
  """`value` with every non-finite float replaced by None; `replaced` collects {path: "nan"|"inf"}."""
  if isinstance(value, dict):
    return {k: strict_json(v, f"{path}.{k}" if path else str(k), replaced) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict_json(v, f"{path}[{i}]", replaced) for i, v in enumerate(value)]
  if isinstance(value, float) and not math.isfinite(value):
    if replaced is not None:
      replaced[path] = str(value)
    return None
  return value


def write(path: pathlib.Path, summary: dict) -> None:
  replaced: dict = {}
  clean = strict_json(summary, replaced=replaced)
  if replaced:  # JSON has no NaN: the value is null and this says what it was
    clean["non_finite_values"] = replaced
  pathlib.Path(path).write_text(json.dumps(clean, indent=1, default=str, allow_nan=False))
