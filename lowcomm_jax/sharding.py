"""Logical axis rules: parameters name their axes ("embed", "mlp", ...); a rules table maps them to mesh axes.

Layouts, as a MaxText user expects them:
- `replicated`: every parameter on every device of a worker; only the batch is split over `data`.
- `fsdp`: parameters sharded over `data` along their "embed" dimension (ZeRO-3 style).
- `tensor`: Megatron-style tensor parallelism over `tensor` ("mlp", "heads", "vocab").
- `fsdp_tensor`: both.
Unlisted logical axes are replicated. `config.sharding.rules` may override single entries.
"""

from __future__ import annotations

from typing import Mapping

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax.models import llama

LAYOUTS: dict[str, dict[str, str]] = {
    "replicated": {},
    "fsdp": {"embed": mesh_lib.DATA},
    "tensor": {"mlp": mesh_lib.TENSOR, "heads": mesh_lib.TENSOR, "vocab": mesh_lib.TENSOR},
    "fsdp_tensor": {"embed": mesh_lib.DATA, "mlp": mesh_lib.TENSOR, "heads": mesh_lib.TENSOR,
                    "vocab": mesh_lib.TENSOR},
}


def rules_for(layout: str, overrides: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
  """The logical → mesh axis table of a layout, with `overrides` applied."""
  if layout not in LAYOUTS:
    raise ValueError(f"sharding.layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
  rules = dict(LAYOUTS[layout])
  for logical, axis in (overrides or {}).items():
    if axis is not None and axis not in mesh_lib.AXES:
      raise ValueError(f"sharding.rules[{logical!r}] must be a mesh axis in {list(mesh_lib.AXES)} "
                       f"or None, got {axis!r}")
    rules[logical] = axis
  return rules


def spec_for(axes: tuple[str, ...], rules: Mapping[str, str | None]) -> P:
  return P(*(rules.get(a) for a in axes))


def param_specs(axes_by_path: Mapping[str, tuple[str, ...]], params, rules, mesh,
                leading: tuple = ()) -> dict:
  """PartitionSpecs for a pure-dict parameter tree; checks every sharded dim divides evenly.

  Args:
    leading: mesh axes for extra leading dims (e.g. `(REPLICA,)` for stacked replicas).
  """

  def spec(key_path, leaf):
    name = llama.path_name(key_path)
    s = spec_for(axes_by_path[name], rules)
    dims = leaf.shape[len(leading):]
    for dim, axis, logical in zip(dims, s, axes_by_path[name]):
      if axis is not None and dim % mesh.shape[axis]:
        raise ValueError(f"parameter {name}: dimension {logical!r} of size {dim} is not divisible "
                         f"by mesh axis {axis!r} of size {mesh.shape[axis]}; change sharding.layout "
                         "or the mesh")
    return P(*leading, *s)

  return jax.tree_util.tree_map_with_path(spec, params)


def named(mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
