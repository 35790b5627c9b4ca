"""Logical axis rules: parameters name their axes ("embed", "mlp", ...); a rules table maps them to
mesh axes.

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


def rules_for(
  layout: str, overrides: Mapping[str, str | None] | None = None
) -> dict[str, str | None]:
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
                         f"by mesh axis {axis!r} of size {mesh.shape[axis]}; change "
                         f"sharding.layout or the mesh")
    return P(*leading, *s)

  return jax.tree_util.tree_map_with_path(spec, params)


def named(mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def state_specs(abstract_state, abstract_params, specs, batched=False, lead_axis=mesh_lib.REPLICA):
  """PartitionSpecs of an optimizer or train state from its parameters' specs.

  A state leaf takes the spec of the parameter whose path its own path ends with ("…/trace/blocks/
  attn/wq" → "blocks/attn/wq") when it has that parameter's shape, or that shape with a shorter
  leading axis and the spec leaves that axis unsharded: a fragment's layer slice [L/P, ...] of a
  stacked [L, ...] leaf (`lowcomm_jax.optim.fragments`). Any other leaf is replicated.

  Args:
    abstract_state: the state (arrays or ShapeDtypeStructs).
    abstract_params: the (unstacked) parameter tree the specs belong to.
    specs: the parameters' PartitionSpecs, same tree.
    batched: a bool, or a tree of bools that is a prefix of the state: True where a leaf has a
      leading replica axis (its shape is checked without it); that axis gets `lead_axis`.
  """
  is_spec = lambda x: isinstance(x, P)
  flat_specs = {llama.path_name(k): tuple(s) for k, s in
                jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]}
  shapes = {llama.path_name(k): tuple(v.shape) for k,
            v in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}

  def matches(shape, param_shape, spec) -> bool:
    if shape == param_shape:
      return True
    layer_slice = (len(shape) == len(param_shape) >= 1 and shape[1:] == param_shape[1:]
                   and shape[0] <= param_shape[0])
    return layer_slice and (not spec or spec[0] is None)

  def spec_of(key_path, leaf, is_batched):
    name = llama.path_name(key_path)
    shape = tuple(leaf.shape[1:] if is_batched else leaf.shape)
    spec = ()
    for param_name, param_spec in flat_specs.items():
      if ((name == param_name or name.endswith("/" + param_name))
          and matches(shape, shapes[param_name], param_spec)):
        spec = param_spec
        break
    return P(*((lead_axis,) if is_batched else ()), *spec)

  batched = jax.tree.broadcast(batched, abstract_state)
  return jax.tree_util.tree_map_with_path(spec_of, abstract_state, batched)
