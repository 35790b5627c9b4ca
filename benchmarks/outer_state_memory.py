"""Bytes per device of Streaming DiLoCo's outer state under the `fsdp` layout, on 8 fake CPU
devices.

  python benchmarks/outer_state_memory.py --label=after
  PYTHONPATH=/work/main python benchmarks/outer_state_memory.py --label=before   # another checkout

The `small` model, Streaming DiLoCo with P = 2 block fragments (+ the non-block fragment), τ = 1
(in-flight buffers), e3m0 with error feedback (residuals), M = 2 replicas on `mesh.replica=2`
× `mesh.data=4`, `sharding.layout=fsdp`. The train state is built by the Trainer exactly as a run
builds it; each outer-state field (φ, the outer optimizer states, the in-flight buffers, the
residuals) is summed over the shards that live on device 0. A field sharded like its parameters
holds about 1/4 of its global bytes there (the `data` axis has 4 devices), a replicated one all of
them. Writes (merges, under `--label`) benchmarks/results/outer_state_memory.json.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import pathlib
import tempfile

import jax
from absl import app, flags

from lowcomm_jax import config as config_lib
from lowcomm_jax.train import Trainer

_LABEL = flags.DEFINE_string("label", "after",
                             "Name of this measurement in the JSON (e.g. before/after).")
_OUT = flags.DEFINE_string(
  "out",
  str(pathlib.Path(__file__).parent / "results" / "outer_state_memory.json"),
  "Where to write the results.",
)

FIELDS = ("outer_params", "outer_states", "in_flight", "residuals", "inner_state")


def _config():
  c = config_lib.default_config()
  config_lib.override(c, {
      "model.size": "small", "algorithm": "streaming_diloco", "num_replicas": 2, "mesh.replica": 2,
      "mesh.data": 4, "sharding.layout": "fsdp", "outer.num_fragments": 2, "outer.sync_every": 6,
      "outer.overlap_steps": 1, "outer.codec": "e3m0", "outer.error_feedback": True,
      "progress_bar": False})
  return c


def _bytes(tree, device) -> tuple[int, int]:
  """(bytes on `device`, global bytes) of every array in `tree`."""
  local = global_ = 0
  for leaf in jax.tree.leaves(tree):
    global_ += leaf.nbytes
    local += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
  return local, global_


def main(argv):
  del argv
  trainer = Trainer(_config(), pathlib.Path(tempfile.mkdtemp()) / "w")
  state = trainer.init_state().opt_state
  device = jax.devices()[0]
  rows = {}
  for field in FIELDS:
    holder = state.comm if field in ("in_flight", "residuals") else state  # keyed by plan name
    local, global_ = _bytes(getattr(holder, field), device)
    rows[field] = {"bytes_on_device_0": local, "global_bytes": global_}
  outer = [rows[f] for f in FIELDS[:4]]
  rows["outer state (φ, outer opt, in-flight, residuals)"] = {
      "bytes_on_device_0": sum(r["bytes_on_device_0"] for r in outer),
      "global_bytes": sum(r["global_bytes"] for r in outer)}
  print(f"{_LABEL.value}: small model, streaming_diloco P=2 (+non-block), τ=1, e3m0+EF, M=2, "
        f"mesh replica=2 × data=4, fsdp; code from {pathlib.Path(config_lib.__file__).parents[1]}")
  print(f"{'field':52s} {'device 0 (MB)':>14s} {'global (MB)':>12s} {'share':>7s}")
  for name, r in rows.items():
    share = r["bytes_on_device_0"] / r["global_bytes"] if r["global_bytes"] else 0.0
    print(f"{name:52s} {r['bytes_on_device_0'] / 2**20:14.3f} "
          f"{r['global_bytes'] / 2**20:12.3f} {share:7.3f}")
  out = pathlib.Path(_OUT.value)
  results = json.loads(out.read_text()) if out.exists() else {}
  results[_LABEL.value] = {"code": str(pathlib.Path(config_lib.__file__).parents[1]),
                           "fields": rows}
  out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
  app.run(main)
