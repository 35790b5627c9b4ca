"""torchft's DiLoCo on our decoder (torch_decoder.py), timed in process CPU-seconds per inner step.

Runs in torchft's virtual environment (torch + torchft, no JAX), driven by benchmarks/step_speed.py:

  python benchmarks/peers/torchft_diloco.py --vocab_size=256 --d_model=128 --num_layers=6 \
      --num_heads=4 --d_ff=384 --seq_len=128 --batch=8 --replicas=2 --sync_every=10

The driver (this script without --replica_id) starts torchft's lighthouse in its own process and K
replica processes (this script with --replica_id), each with its own TCPStore, a gloo process
group and a torchft `Manager` (synchronous quorum, as DiLoCo requires), and wraps the inner
optimizer in `torchft.local_sgd.DiLoCo` (H = sync_every; outer SGD with Nesterov momentum, lr 0.7,
momentum 0.9, as our outer optimizer). Inner: AdamW (lr 3e-3, β = (0.9, 0.95), weight decay 0.1)
after a global-norm clip to 1.0, as our default optimizer. Each replica trains on its own fixed
random batch [batch, seq_len + 1] of tokens.

Protocol (one JSON object per line on stdout): after start-up and `--warmup` inner steps the driver
prints {"ready": ...} (shape, parameters, FLOPs per token from torch's counter, versions), then
reads commands from stdin: `run N` runs N inner steps on every replica (N a multiple of H, so that
every timed window holds the same syncs) and prints {"cpu_seconds": ..., "wall_seconds": ...}: the
sum over replicas (and the driver with its lighthouse) of process CPU-seconds spent in those N
steps, and the wall time; `quit` stops everything.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import torch_decoder  # pylint: disable=g-import-not-at-top,wrong-import-position


def _args(argv=None):
  p = argparse.ArgumentParser()
  torch_decoder.add_shape_args(p)
  p.add_argument("--batch", type=int, default=8, help="sequences per replica per inner step")
  p.add_argument("--replicas", type=int, default=2, help="K: DiLoCo replicas (processes)")
  p.add_argument("--sync_every", type=int, default=10, help="H: inner steps between outer steps")
  p.add_argument("--warmup", type=int, default=10, help="inner steps before the driver says ready")
  p.add_argument("--threads", type=int, default=0,
                 help="torch threads per replica; 0: the machine's cores / K (at least 1)")
  p.add_argument("--replica_id", type=int, default=-1, help="internal: run as this replica")
  p.add_argument("--lighthouse", default="", help="internal: the lighthouse's address")
  return p.parse_args(argv)


def _say(obj):
  print(json.dumps(obj), flush=True)


def replica_main(a):
  """One DiLoCo replica: a Manager of a one-rank replica group, DiLoCo around AdamW."""
  from torch.distributed import TCPStore  # pylint: disable=g-import-not-at-top
  from torchft.local_sgd import DiLoCo  # pylint: disable=g-import-not-at-top
  from torchft.manager import Manager  # pylint: disable=g-import-not-at-top
  from torchft.process_group import ProcessGroupGloo  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // a.replicas))
  torch.manual_seed(0)  # the same initial model on every replica (torchft also syncs it at step 0)
  model = torch_decoder.Decoder(torch_decoder.shape_from_args(a))
  inner = torch_decoder.inner_optimizer(model)
  outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
  gen = torch.Generator().manual_seed(1 + a.replica_id)
  batch = torch.randint(0, a.vocab_size, (a.batch, a.seq_len + 1), generator=gen)

  store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
  timeout = timedelta(seconds=120)
  manager = Manager(
      pg=ProcessGroupGloo(timeout=timeout), min_replica_size=a.replicas, use_async_quorum=False,
      load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                  inner.load_state_dict(sd["inner"])),
      state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
      replica_id=f"replica_{a.replica_id}", store_addr="localhost", store_port=store.port, rank=0,
      world_size=1, lighthouse_addr=a.lighthouse, port=0, timeout=timeout, quorum_timeout=timeout,
      connect_timeout=timeout)

  try:
    with DiLoCo(manager, [model], inner, outer, sync_every=a.sync_every,
                backup_device=torch.device("cpu"),
                pin_memory=False):
      torch_decoder.inner_steps(model, inner, batch, a.warmup)
      _say({"replica": a.replica_id, "ready": True})
      for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
          break
        cpu, wall = time.process_time(), time.perf_counter()
        loss = torch_decoder.inner_steps(model, inner, batch, int(cmd[1]))
        _say({"replica": a.replica_id, "cpu_seconds": time.process_time() - cpu,
              "wall_seconds": time.perf_counter() - wall, "loss": loss,
              "manager_step": manager.current_step()})
  finally:
    manager.shutdown(wait=False)


def driver_main(a):
  """The lighthouse in this process, K replica processes, and the stdin/stdout protocol."""
  from torchft._torchft import LighthouseServer  # pylint: disable=g-import-not-at-top

  if a.warmup % a.sync_every or a.warmup < a.sync_every:
    sys.exit(f"--warmup={a.warmup} must be a positive multiple of --sync_every={a.sync_every}")
  lighthouse = LighthouseServer(bind="[::]:0", min_replicas=a.replicas)
  argv = [sys.executable, __file__] + [f"--{k}={v}" for k, v in vars(a).items()
                                       if k not in ("replica_id", "lighthouse")]
  procs = [subprocess.Popen(argv + [f"--replica_id={i}", f"--lighthouse={lighthouse.address()}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
           for i in range(a.replicas)]

  def read_all():
    out = []
    for p in procs:
      line = p.stdout.readline()
      while line and not line.startswith("{"):  # torch or torchft may print to stdout
        line = p.stdout.readline()
      if not line:
        raise RuntimeError(f"a torchft replica exited (code {p.wait()})")
      out.append(json.loads(line))
    return out

  try:
    read_all()
    shape = torch_decoder.shape_from_args(a)
    _say({"ready": True, "torch": torch.__version__,
          "torchft": importlib.metadata.version("torchft"),
          "params": torch_decoder.param_count(torch_decoder.Decoder(shape)),
          "flops_per_token": torch_decoder.training_flops_per_token(shape, a.seq_len),
          "tokens_per_step": a.replicas * a.batch * a.seq_len,
          "threads_per_replica": a.threads or max(1, (os.cpu_count() or 1) // a.replicas)})
    for line in sys.stdin:
      cmd = line.split()
      if not cmd or cmd[0] == "quit":
        break
      if cmd[0] != "run" or int(cmd[1]) % a.sync_every:
        sys.exit(f"unknown command {line.strip()!r}: expected 'run N' with N a multiple of H or "
                 f"'quit'")
      cpu = time.process_time()
      for p in procs:
        p.stdin.write(line)
        p.stdin.flush()
      results = read_all()
      _say({"cpu_seconds": sum(r["cpu_seconds"] for r in results) + time.process_time() - cpu,
            "wall_seconds": max(r["wall_seconds"] for r in results),
            "replica_cpu_seconds": [r["cpu_seconds"] for r in results],
            "loss": [r["loss"] for r in results], "manager_step": results[0]["manager_step"]})
  finally:
    for p in procs:
      if p.poll() is None:
        p.stdin.write("quit\n")
        p.stdin.flush()
    for p in procs:
      try:
        p.wait(timeout=60)
      except subprocess.TimeoutExpired:
        p.kill()
    lighthouse.shutdown()


if __name__ == "__main__":
  args = _args()
  if args.replica_id >= 0:
    replica_main(args)
  else:
    driver_main(args)
