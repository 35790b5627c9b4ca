"""One torch replica's inner step on our decoder (torch_decoder.py), no torchft, timed in
CPU-seconds.

Runs in the torchft virtual environment (torch only is used), driven by
benchmarks/step_breakdown.py:

  python benchmarks/peers/torch_step.py --vocab_size=256 --d_model=128 --num_layers=6 \
      --num_heads=4 --d_ff=384 --seq_len=128 --batch=8 --threads=1 [--no_attention]

The same inner step as one replica of torchft_diloco.py (AdamW after a global-norm clip), on the
threads given (torchft_diloco.py gives each of its K = 2 replicas one thread on this 2-core
machine). `--no_attention` replaces `scaled_dot_product_attention` by the mean of q, k and v (the
projections and rotary stay), so that the difference of the two runs is attention's cost in the
step. Protocol as the other peers: {"ready": ...} after `--warmup` steps, then one
{"cpu_seconds", "wall_seconds", "loss"} per `run N` line on stdin; `quit` stops.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import torch_decoder  # pylint: disable=g-import-not-at-top,wrong-import-position


def _say(obj):
  print(json.dumps(obj), flush=True)


def main():
  p = argparse.ArgumentParser()
  torch_decoder.add_shape_args(p)
  p.add_argument("--batch", type=int, default=8, help="sequences per step")
  p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
  p.add_argument("--warmup", type=int, default=10, help="steps before saying ready")
  p.add_argument("--no_attention", action="store_true",
                 help="attention replaced by (q + k + v) / 3: the ablation's baseline")
  a = p.parse_args()
  torch.set_num_threads(a.threads)
  if a.no_attention:  # torch_decoder calls it as F.scaled_dot_product_attention at run time
    F.scaled_dot_product_attention = lambda q, k, v, is_causal: (q + k + v) / 3
  torch.manual_seed(0)
  model = torch_decoder.Decoder(torch_decoder.shape_from_args(a))
  optimizer = torch_decoder.inner_optimizer(model)
  batch = torch.randint(0, a.vocab_size, (a.batch, a.seq_len + 1),
                        generator=torch.Generator().manual_seed(1))
  torch_decoder.inner_steps(model, optimizer, batch, a.warmup)
  _say({"ready": True, "torch": torch.__version__, "threads": a.threads,
        "tokens_per_step": a.batch * a.seq_len, "no_attention": a.no_attention})
  for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
      break
    if cmd[0] != "run":
      sys.exit(f"unknown command {line.strip()!r}: expected 'run N' or 'quit'")
    cpu, wall = time.process_time(), time.perf_counter()
    loss = torch_decoder.inner_steps(model, optimizer, batch, int(cmd[1]))
    _say({"cpu_seconds": time.process_time() - cpu, "wall_seconds": time.perf_counter() - wall,
          "loss": loss})


if __name__ == "__main__":
  main()
