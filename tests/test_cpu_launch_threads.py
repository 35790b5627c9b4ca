"""XLA's CPU thread pools with threads to spare when XLA presents fake CPU devices
(`compat.cpu_launch_threads_for_fake_devices`, applied when lowcomm_jax is imported): a fresh
process with 8 fake devices and no NPROC gets pools of 32 threads; a process that sets NPROC, or
has no fake devices, keeps what it chose."""

import os
import subprocess
import sys

import pytest

_REPORT = """
import collections, os
import lowcomm_jax, jax
jax.numpy.ones(3).block_until_ready()  # starts the CPU client and its pools
names = collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip()
                            for t in os.listdir("/proc/self/task"))
print(os.environ.get("NPROC"), len(jax.devices()), names["tf_XLAEigen"])
"""


def _report(**env_changes) -> tuple:
  env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "XLA_FLAGS")}
  env.update({k: v for k, v in env_changes.items() if v is not None})
  out = subprocess.run([sys.executable, "-c", _REPORT], env=env, capture_output=True, text=True,
                       timeout=120, check=True).stdout.split()
  return out[0], int(out[1]), int(out[2])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names from Linux /proc")
def test_fake_devices_get_pools_with_threads_to_spare():
  flags = "--xla_force_host_platform_device_count=8"
  nproc, devices, eigen = _report(XLA_FLAGS=flags)
  assert (devices, nproc) == (8, str(max(os.cpu_count(), 32)))
  assert eigen == max(os.cpu_count(), 32)  # the intra-op pool, sized as the launch pool is
  # NPROC chosen by the environment is kept: XLA then sizes its pools at max(NPROC, devices)
  assert _report(XLA_FLAGS=flags, NPROC="3") == ("3", 8, 8)
  # one device: nothing is set
  nproc, devices, _ = _report()
  assert (nproc, devices) == ("None", 1)
