"""Named mesh axes and the mesh builder.

Axes, slowest to fastest:
- `replica`: model copies (DiLoCo workers); the slow, cross-datacenter axis.
- `data`: data parallelism / FSDP inside a worker.
- `tensor`: tensor parallelism inside a worker.
- `stage`: pipeline stages.
"""

from __future__ import annotations

import contextlib
import math
from typing import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

REPLICA = "replica"
DATA = "data"
TENSOR = "tensor"
STAGE = "stage"
AXES = (REPLICA, DATA, TENSOR, STAGE)


def mesh_shape(requested: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Resolves a requested shape (at most one axis may be -1: all remaining devices).

  Raises:
    ValueError: naming the `mesh` option when an axis is unknown or < 1, or
      the shape needs more devices than there are.
  """
  unknown = set(requested) - set(AXES)
  if unknown:
    raise ValueError(f"mesh has unknown axes {sorted(unknown)}; allowed axes are {list(AXES)}")
  shape = {axis: int(requested.get(axis, 1)) for axis in AXES}
  fill = [a for a, n in shape.items() if n == -1]
  if len(fill) > 1:
    raise ValueError(f"at most one mesh axis may be -1 (fill), got {fill}")
  bad = {a: n for a, n in shape.items() if n < 1 and n != -1}
  if bad:
    raise ValueError(f"mesh axis sizes must be >= 1 or -1 (fill), got {bad}")
  fixed = math.prod(n for n in shape.values() if n != -1)
  if fill:
    if num_devices % fixed:
      raise ValueError(f"mesh {shape}: the fixed axes' product {fixed} does not divide the "
                       f"{num_devices} devices, so mesh.{fill[0]}=-1 cannot fill them")
    shape[fill[0]] = num_devices // fixed
  if math.prod(shape.values()) > num_devices:
    raise ValueError(
        f"mesh {shape} needs {math.prod(shape.values())} devices but {num_devices} are available; "
        f"set --config.mesh.* so the product of replica·data·tensor·stage is at most {num_devices}")
  return shape


def make_mesh(requested: Mapping[str, int], devices=None) -> Mesh:
  """A mesh with the four named axes (Auto axis types) over the first devices that fit.

  Devices are taken process by process, so with several processes the slowest axis (`replica`)
  is the one that crosses them and the inner axes stay inside a process.
  """
  if devices is None:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  devices = list(devices)
  shape = mesh_shape(requested, len(devices))
  n = math.prod(shape.values())
  device_grid = np.asarray(devices[:n]).reshape(tuple(shape[a] for a in AXES))
  return Mesh(device_grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _same_axes(a, b) -> bool:
  return tuple(a.axis_names) == tuple(b.axis_names) and tuple(a.axis_sizes) == tuple(b.axis_sizes)


def tracing(mesh):
  """Context for tracing a program on `mesh`: its abstract mesh, which a Pallas kernel needs to
  run under a `shard_map` manual over every axis (`codecs.kernels.on_every_axis`). An abstract
  mesh already set with the same axes stands (one naming the device a program is lowered for,
  such as a GPU while lowering on a CPU host)."""
  if _same_axes(jax.sharding.get_abstract_mesh(), mesh):
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def current(mesh):
  """The mesh a `shard_map` over `mesh`'s axes names: the abstract mesh of the context (`tracing`)
  when it has the same axes, else `mesh`."""
  context = jax.sharding.get_abstract_mesh()
  return context if _same_axes(context, mesh) else mesh


def varying_axes(x) -> frozenset:
  """The manual mesh axes a traced value varies over (empty outside `jax.shard_map`)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary_like(x, *like):
  """`x` marked varying over the manual mesh axes any of `like` varies over.

  A custom call's results, and a nested `shard_map`'s without type checks (`check_vma=False`),
  carry no varying axes, while the values computed in their place would vary as their operands
  do. Differentiated, the mark (`pcast` to varying) transposes to a sum of the cotangents over those
  axes, so a value that is differentiated is marked inside a `jax.custom_vjp`'s rules.
  """
  missing = tuple(sorted(frozenset().union(*map(varying_axes, like)) - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x
