"""What a run says when it starts: one line naming the model, the mesh, the tokens per step, the
algorithm and the workdir, and warnings about a layout or mesh that does not do what it seems to."""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

FAKE_DEVICES_FLAG = "XLA_FLAGS=--xla_force_host_platform_device_count"


def fake_devices_hint(requested: dict, devices=None) -> str:
  """How to get the devices a mesh asks for on a CPU host ("" elsewhere, or when they are there)."""
  devices = list(jax.devices() if devices is None else devices)
  needed = math.prod(max(int(n), 1) for n in requested.values())
  if needed <= len(devices) or {d.platform for d in devices} != {"cpu"}:
    return ""
  return (f"; on CPU, JAX presents {needed} devices when started with "
          f"{FAKE_DEVICES_FLAG}={needed} in the environment")


def startup_line(config, model_cfg, num_params: int, mesh, workdir,
                 codec_kernel: str | None = None) -> str:
  """"model tiny (2 layers, d_model 32, 101,376 parameters) | mesh replica=1 data=8 … on 8 cpu
  devices | 1,024 tokens per step (1 replica × 16 sequences × 64 tokens) | algorithm dp, gradients
  replicas | workdir /abs/run"; with ``codec_kernel`` (what encodes the outer gradients,
  ``codecs.kernel_choice``) the algorithm's part ends ", codec e3m0 by pallas_mosaic_gpu"."""
  c = config
  platforms = ",".join(sorted({d.platform for d in mesh.devices.flat}))
  axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
  tokens = c.num_replicas * c.data.batch_size * c.data.seq_len
  replicas = f"{c.num_replicas} replica{'s' if c.num_replicas > 1 else ''}"
  per_step = f"{replicas} × {c.data.batch_size} sequences × {c.data.seq_len} tokens"
  if c.optimizer.accumulation_steps > 1:
    per_step += f", in {c.optimizer.accumulation_steps} micro-batches"
  codec = f", codec {c.outer.codec} by {codec_kernel}" if codec_kernel else ""
  return (f"model {c.model.size} ({model_cfg.num_layers} layers, d_model {model_cfg.d_model}, "
          f"{num_params:,} parameters) | mesh {axes} on {mesh.devices.size} {platforms} "
          f"device{'s' if mesh.devices.size > 1 else ''} | "
          f"{tokens:,} tokens per step ({per_step}) | algorithm {c.algorithm}, gradients "
          f"{c.gradients}{codec} | workdir {workdir.absolute()}")


def startup_warnings(config, mesh, param_specs) -> list[str]:
  """A layout that shards nothing on this mesh (`fsdp` with a data axis of 1 device, …)."""
  specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
  named = {a for s in specs for entry in s if entry is not None
           for a in (entry if isinstance(entry, tuple) else (entry,))}
  if config.sharding.layout == "replicated" or any(mesh.shape[a] > 1 for a in named):
    return []
  axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
  hint = fake_devices_hint({**mesh.shape, **{a: max(2, mesh.shape[a]) for a in named}},
                           jax.devices())
  return [f"warning: sharding.layout={config.sharding.layout!r} shards no parameter on this mesh "
          f"({axes}): every device holds the whole model; give the layout's axes more than one "
          f"device (mesh.*){hint}"]
