"""Model FLOPs utilisation (MFU): the model's FLOP rate over the peak of the hardware that ran it.

One definition for the Trainer and every benchmark (`RunPeak.mfu`, `cpu_mfu`):

- On CPU (no declared peak), both sides are counted in process CPU-seconds:

    MFU = (F / (C · P)) / (F_mm / C_mm)

  F: the model FLOPs of the counted steps, all processes (steps · tokens per step · FLOPs per
  token, models.flops_per_token); C: this process's CPU-seconds over those steps
  (`time.process_time`, every thread of the process: XLA's pool and the Python loop); P: the number
  of processes (each counts its own CPU-seconds; they are alike); F_mm / C_mm: the FLOPs per
  process CPU-second of a float32 [1024, 1024] matmul loop dispatched on every local device at once
  (`measure_host_peak`). Multiplying numerator and denominator by n, the cores the process may
  use (`usable_cores`), reads it as FLOP/s: the step's FLOPs per second on n fully busy cores over
  the host's peak n · F_mm / C_mm (`RunPeak.flops_per_second`). Time other processes take from
  ours counts on neither side, so a loaded machine no longer inflates or deflates it: the old
  wall-clock form divided a step's wall time under one load by a peak measured once at start
  under another, and logged MFU > 1. It is 1 for a step that does only that matmul, and below 1
  for one that moves data, waits on the Python loop, or idles threads.
- On accelerators, per wall-second:

    MFU = (F / T) / (peak per device · devices)

  T: wall seconds; the peak per device is `hardware.peak_flops_per_device` when set (> 0), else
  the chip's dense bfloat16 datasheet peak looked up by its `device_kind` in `BF16_PEAKS`
  (`datasheet_peak`). An accelerator the table does not know divides by the same matmul's
  measured wall-clock rate on every local device × processes (its CPU-seconds do not count device
  work); set `hardware.peak_flops_per_device` for it.

The peak is that of the whole host, not one device's times the device count: XLA's CPU backend
runs every (fake) device of a process on one shared pool of threads, so one device's matmul
already uses every core.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp

# Dense (no structured sparsity) bfloat16 matmul FLOP/s per JAX device, from the vendors'
# datasheets, keyed by a lower-case substring of `jax.Device.device_kind`; the first match wins, so
# a variant comes before its family. On every TPU listed one JAX device is one chip.
BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756e12),  # NVIDIA H100 PCIe
    ("h100 nvl", 835e12),  # NVIDIA H100 NVL
    ("h100", 989e12),  # NVIDIA H100 SXM ("NVIDIA H100 80GB HBM3")
    ("h200", 989e12),  # NVIDIA H200 SXM
    ("a100", 312e12),  # NVIDIA A100, SXM and PCIe, 40 and 80 GB
    ("tpu v4", 275e12),  # TPU v4 ("TPU v4")
    ("tpu v5 lite", 197e12),  # TPU v5e ("TPU v5 lite")
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),  # TPU v5p reports "TPU v5"
    ("tpu v6 lite", 918e12),  # TPU v6e, Trillium ("TPU v6 lite")
    ("tpu v6e", 918e12),
)


def datasheet_peak(device_kind: str) -> float | None:
  """The dense bfloat16 peak FLOP/s of one device of this `device_kind` (`BF16_PEAKS`), or None."""
  kind = device_kind.lower()
  return next((peak for key, peak in BF16_PEAKS if key in kind), None)


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
  """`measure_host_peak()`, measured once per process (runs in one process share it). In
  CPU-seconds the load at the time of measuring cancels, so once is enough."""
  return measure_host_peak()


def usable_cores() -> int:
  """The cores this process may run on (its CPU affinity), which XLA's thread pool fills."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def cpu_mfu(flops: float, cpu_seconds: float, peak_flops_per_cpu_second: float) -> float:
  """MFU on CPU: `flops` done in this process's `cpu_seconds` over the matmul's FLOPs per
  CPU-second (divide `flops` by the process count first when it counts every process's work)."""
  return flops / cpu_seconds / peak_flops_per_cpu_second


@dataclasses.dataclass(frozen=True)
class RunPeak:
  """What a run's MFU divides by; `clock` is "cpu" (process CPU-seconds) or "wall"."""

  clock: str
  # the run's peak as FLOP/s (cpu: cores · processes · FLOPs per CPU-second)
  flops_per_second: float
  flops_per_cpu_second: float = 0.0  # cpu: the host matmul's FLOPs per process CPU-second
  processes: int = 1

  def mfu(self, flops: float, wall_seconds: float, cpu_seconds: float) -> float:
    """MFU of `flops` (every process's) done in `wall_seconds` / this process's `cpu_seconds`."""
    if self.clock == "cpu":
      return cpu_mfu(flops / self.processes, cpu_seconds, self.flops_per_cpu_second)
    return flops / wall_seconds / self.flops_per_second


def run_peak(peak_flops_per_device: float, num_devices: int, devices=None) -> RunPeak:
  """The run's peak, on the wall clock unless on CPU: a declared per-device peak × devices; else,
  on an accelerator whose `device_kind` is in `BF16_PEAKS`, its datasheet peak × devices; on CPU
  the measured host matmul in CPU-seconds; on another accelerator, the measured host matmul per
  wall-second × processes. `devices`: the run's devices (default every device)."""
  processes = jax.process_count()
  if peak_flops_per_device > 0:
    return RunPeak("wall", peak_flops_per_device * num_devices, processes=processes)
  devices = list(devices if devices is not None else jax.devices())
  if devices[0].platform != "cpu":
    known = {datasheet_peak(d.device_kind) for d in devices}
    if len(known) == 1 and None not in known:  # one known chip throughout
      return RunPeak("wall", known.pop() * num_devices, processes=processes)
  measured = host_peak()
  if devices[0].platform == "cpu":
    return RunPeak("cpu", measured.flops_per_cpu_second * usable_cores() * processes,
                   measured.flops_per_cpu_second, processes)
  return RunPeak("wall", measured.flops_per_second * processes, processes=processes)
