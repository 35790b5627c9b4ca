"""Model FLOPs utilisation: the model's matmul FLOP rate over a matmul peak measured on this host.

One definition for the Trainer and every benchmark:

  MFU = tokens per second · FLOPs per token (models.flops_per_token) / host peak FLOP/s

The peak is that of the whole host, measured, not one device's times the device count: XLA's CPU
backend runs every (fake) device of a process on one shared pool of threads, so one device's matmul
already uses every core, and the old "one-device peak × 8" made an 8-fake-device run look 8× less
efficient than it was. The peak is measured by running the same float32 matmul on every local
device at once, so it is also right on a host with several real accelerators.

Both rates may be per wall-second (what a training log shows) or per process CPU-second (what the
benchmarks use on a shared machine, where other processes' load would otherwise count against us);
`HostPeak` holds both, measured in the same loop.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class HostPeak:
  """Float32 matmul FLOPs of the whole host, per wall-second and per process CPU-second."""

  flops_per_second: float
  flops_per_cpu_second: float


def measure_host_peak(size: int = 1024, seconds: float = 0.3, devices=None) -> HostPeak:
  """Times [size, size] float32 matmuls dispatched on every local device concurrently."""
  devices = devices or jax.local_devices()
  matmul = jax.jit(lambda x: x @ x)
  inputs = [jax.device_put(jnp.ones((size, size), jnp.float32), d) for d in devices]
  jax.block_until_ready([matmul(a) for a in inputs])  # compile for each device
  rounds = 0
  cpu_start, start = time.process_time(), time.perf_counter()
  while time.perf_counter() - start < seconds or rounds < 2:
    jax.block_until_ready([matmul(a) for a in inputs])
    rounds += 1
  wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
  flops = 2 * size**3 * rounds * len(devices)
  return HostPeak(flops / wall, flops / max(cpu, 1e-9))


@functools.lru_cache(maxsize=1)
def host_peak() -> HostPeak:
  """`measure_host_peak()`, measured once per process (runs in one process share it)."""
  return measure_host_peak()


def run_peak_flops(peak_flops_per_device: float, num_devices: int) -> float:
  """The FLOP/s an MFU divides by: a declared per-device peak × devices (accelerators whose
  datasheet peak is known), else the measured host peak × processes (each process one host)."""
  if peak_flops_per_device > 0:
    return peak_flops_per_device * num_devices
  return host_peak().flops_per_second * jax.process_count()


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
  """Model FLOPs utilisation; `tokens_per_second` and `peak_flops` in the same time unit."""
  return tokens_per_second * flops_per_token / peak_flops
