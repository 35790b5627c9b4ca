"""MaxText's train step on a given decoder shape, timed in process CPU-seconds per step.

Runs in MaxText's virtual environment (Python >= 3.12, maxtext 0.2.5 with its `tpu` extra's
requirements minus libtpu), driven by benchmarks/step_speed.py:

  python benchmarks/peers/maxtext_step.py --vocab_size=256 --d_model=128 --num_layers=4 \
      --num_heads=4 --d_ff=512 --seq_len=128 --devices=8 --per_device_batch=4 --dtype=float32

MaxText is configured from the config its own tests use off Google Cloud (`decoupled_base_test.yml`,
with DECOUPLE_GCLOUD=TRUE: no GCS, goodput or checkpoints; dot-product attention), on `--devices`
fake CPU devices, with the given shape (llama2 decoder block: RMSNorm, rotary, SwiGLU, untied head),
synthetic data, data parallelism over every device (as our data-parallel Trainer) and everything
else at MaxText's defaults: AdamW, global-norm clipping, scanned layers and `remat_policy: full`
(the backward recomputes the forward). The step is MaxText's `train_step` jitted by MaxText's own
`train_utils.jit_train_and_eval_step`, as its `train_loop` does, on one synthetic batch.

Protocol (one JSON object per line on stdout): {"ready": ...} after two warm-up steps, then for each
`run N` read from stdin {"cpu_seconds": ..., "wall_seconds": ...} of N steps; `quit` stops.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import sys
import tempfile
import time


def _args():
  p = argparse.ArgumentParser()
  for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "seq_len", "devices",
               "per_device_batch"):
    p.add_argument(f"--{name}", type=int, required=True)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  return p.parse_args()


def _say(obj):
  print(json.dumps(obj), file=_STDOUT, flush=True)


_STDOUT = sys.stdout


def main():
  global _STDOUT
  a = _args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={a.devices}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["DECOUPLE_GCLOUD"] = "TRUE"
  # MaxText logs to stdout; the protocol keeps stdout for itself.
  _STDOUT, sys.stdout = sys.stdout, sys.stderr

  import jax  # pylint: disable=g-import-not-at-top
  import maxtext  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from flax.core.spmd import logical_axis_rules  # pylint: disable=g-import-not-at-top
  from maxtext.trainers.pre_train import train as mt_train  # pylint: disable=g-import-not-at-top
  from maxtext.utils import sharding, train_utils  # pylint: disable=g-import-not-at-top

  config_path = pathlib.Path(maxtext.__file__).parent / "configs" / "decoupled_base_test.yml"
  out_dir = tempfile.mkdtemp(prefix="maxtext_step_")
  config, recorder = mt_train.initialize([
      None, str(config_path), "run_name=step_speed", f"base_output_directory={out_dir}",
      "hardware=cpu", "skip_jax_distributed_system=true", "dataset_type=synthetic",
      "enable_checkpointing=false", "enable_goodput_recording=false", "monitor_goodput=false",
      "steps=1000000", "log_period=1000000", f"vocab_size={a.vocab_size}",
      f"base_emb_dim={a.d_model}", f"base_num_query_heads={a.num_heads}",
      f"base_num_kv_heads={a.num_heads}", f"head_dim={a.d_model // a.num_heads}",
      f"base_mlp_dim={a.d_ff}", f"base_num_decoder_layers={a.num_layers}",
      f"max_target_length={a.seq_len}", f"per_device_batch_size={a.per_device_batch}",
      f"dtype={a.dtype}", "weight_dtype=float32", "ici_data_parallelism=-1",
      "ici_fsdp_parallelism=1",
  ])
  (_, _, state_mesh_shardings, _, mesh, _, _, data_loader, rampup_manager, _,
   state) = train_utils.setup_train_loop(config, recorder)
  jit_model, state = nnx.split(state)
  params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
      config, state_mesh_shardings)
  p_train_step, _ = train_utils.jit_train_and_eval_step(
      config, jit_model, mesh, state, state_mesh_shardings, mt_train.train_step, mt_train.eval_step,
      None, params_shardings)
  params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.merge(jit_model, state).model,
                                                         nnx.Param)))

  with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
    batch = data_loader.load_next_batch(rampup_manager=rampup_manager)

    def steps(n):
      nonlocal state
      metrics = None
      for _ in range(n):
        state, metrics = p_train_step(state, batch)
      jax.block_until_ready(state)
      return metrics

    metrics = steps(2)
    _say({"ready": True, "maxtext": importlib.metadata.version("maxtext"), "jax": jax.__version__,
          "python": sys.version.split()[0], "params": int(params),
          "tokens_per_step": a.devices * a.per_device_batch * a.seq_len,
          "remat_policy": config.remat_policy, "scan_layers": config.scan_layers,
          "attention": config.attention, "loss": float(metrics["scalar"]["learning/loss"])})
    for line in sys.stdin:
      cmd = line.split()
      if not cmd or cmd[0] == "quit":
        break
      cpu, wall = time.process_time(), time.perf_counter()
      steps(int(cmd[1]))
      _say({"cpu_seconds": time.process_time() - cpu, "wall_seconds": time.perf_counter() - wall})


if __name__ == "__main__":
  main()
