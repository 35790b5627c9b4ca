"""Speed of the training step per CPU-second: the Trainer against a plain jitted optax step and
peers.

  nice -n 10 python benchmarks/step_speed.py [--rounds=7 --steps=5 --dtype=float32]
      [--torchft_python=/work/peers/torchft-venv/bin/python]
      [--maxtext_python=/work/peers/maxtext-venv/bin/python]

Setups on the `small` model (1,345,152 parameters), batch 16 × 128, one CPU device:
- `trainer`: the Trainer's compiled data-parallel program (`Trainer.program`), as `run()` calls it;
- `plain jit`: a hand-written `jax.jit` of `value_and_grad` + the same optax transformation
  (clipped AdamW with the config's schedule), donating its state, no Trainer;
- `trainer, layer_loop=scan`: the Trainer with the layer loop scanned instead of unrolled (the
  unrolling's share of the step);
- `..., attention=cpu_kernel`: the Trainer setups (this one, the DiLoCo and the MaxText-shape one
  below) again with `model.attention="cpu_kernel"`, the fused C++ attention kernel
  (cpu_kernels/attention.py; an option, not the default): `cpu_kernel_over_xla` (its step's
  CPU-seconds ÷ the default's), `torchft_ratio_cpu_kernel`, `maxtext_ratio_cpu_kernel`.
Each timed round runs every setup in turn (this machine is shared: rounds interleave so that
load hits all alike); a round also re-measures the host's float32 matmul peak (train/mfu.py).
Figures are process CPU-seconds per step (`time.process_time`: every XLA thread counts, other
processes' load does not), tokens per CPU-second, and medians of per-round ratios:
`overhead_vs_plain_jit` = trainer CPU-s per step ÷ plain jit's, `mfu_small` = the Trainer's MFU
(train/mfu.cpu_mfu: the trainer's model FLOPs per CPU-second ÷ the host matmul's FLOPs per
CPU-second, the matmul on every local device at once as the Trainer measures it).

Peers, each a long-lived subprocess in its own virtual environment (benchmarks/peers/; a missing
venv skips the peer with the reason in the JSON, as in CI), timed in the same rounds:
- `diloco K=2` against `torchft diloco K=2`: DiLoCo with K = 2 replicas, H = 10, 8 × 128 tokens per
  replica per inner step, the `small` model on both sides (torchft 0.2.0 runs our decoder written in
  torch, benchmarks/peers/torch_decoder.py: same shape, and the same FLOPs per token counted by
  torch's own counter); ours is the Trainer (algorithm=diloco, mesh.replica=2, two CPU devices),
  theirs a lighthouse and two replica processes with a gloo process group. A round is one window of
  H inner steps on each side (the same one outer step in each);
- `dp, MaxText shape` against `maxtext`: MaxText 0.2.5's train step on its CPU test shape
  (1,115,264 parameters: vocabulary 256, d_model 128, 4 layers, 4 heads of 32, SwiGLU width 512;
  8 fake devices × 4 × 128 = 4,096 tokens per step; benchmarks/peers/maxtext_step.py, on MaxText's
  own JAX, 0.12 on Python 3.12) and our data-parallel Trainer on the same shape, devices and tokens.
- `diloco K=2 processes` (and with `attention=cpu_kernel`): our same DiLoCo laid out as torchft's,
  one process per replica, each on its own core (peers/ours_diloco_processes.py: `jax.distributed`
  on 127.0.0.1, the outer all-reduce through gloo), run as a peer subprocess:
  `torchft_ratio_processes` (`_cpu_kernel`).
`torchft_ratio` and `maxtext_ratio` = our tokens per CPU-second ÷ theirs (medians of per-round
ratios; > 1: we are cheaper). Peer CPU-seconds are those of every peer process (torchft: both
replicas and the lighthouse's process).
Writes benchmarks/results/step_speed.json and step_speed.png (tokens per CPU-second per setup).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import functools  # pylint: disable=g-import-not-at-top,wrong-import-position
import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import pathlib
import select
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import optax
from absl import app, flags

from lowcomm_jax import config as config_lib
from lowcomm_jax.models import (
  ModelConfig,
  config as model_config,
  flops_per_token,
  loss as loss_lib,
  param_count,
)
from lowcomm_jax.optim import inner
from lowcomm_jax.train import Trainer, mfu

_ROUNDS = flags.DEFINE_integer("rounds", 7, "Interleaved timed rounds.")
_WARMUP_ROUNDS = flags.DEFINE_integer("warmup_rounds", 1, "Untimed rounds of every setup first.")
_STEPS = flags.DEFINE_integer("steps", 5, "Steps per setup per round.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Activation dtype.")
_OUT = flags.DEFINE_string("out",
                           str(pathlib.Path(__file__).parent / "results" / "step_speed.json"),
                           "Where to write the results (the chart goes beside it, .png).")
_TORCHFT_PYTHON = flags.DEFINE_string("torchft_python", "/work/peers/torchft-venv/bin/python",
                                      "Python of a venv with torch and torchft; absent: peer "
                                      "skipped.")
_MAXTEXT_PYTHON = flags.DEFINE_string("maxtext_python", "/work/peers/maxtext-venv/bin/python",
                                      "Python of a venv with maxtext 0.2.5; absent: peer skipped.")
_PEER_TIMEOUT = flags.DEFINE_integer("peer_timeout", 1800,
                                     "Seconds a peer may take to start or answer.")
_BATCH, _SEQ = 16, 128
# The DiLoCo comparison with torchft: K replicas, H inner steps per outer step, sequences per
# replica.
_K, _H, _DILOCO_BATCH = 2, 10, 8
_PEERS_DIR = pathlib.Path(__file__).parent / "peers"
# Our setups again with model.attention="cpu_kernel" (name suffix); "" on a checkout without the
# key.
_KERNEL = ", attention=cpu_kernel" if "attention" in config_lib.default_config().model else ""
# Each setup name's suffix → its model.attention (None: the config's default).
_ATTENTIONS = {"": None, **({_KERNEL: "cpu_kernel"} if _KERNEL else {})}
# MaxText's CPU test shape (1,115,264 parameters, 4,096 tokens per step on 8 fake devices),
# in our architecture's terms; head_dim = 128 / 4 = 32. MaxText builds the same tensors
# (q, k, v, o, SwiGLU wi_0, wi_1, wo, two norms per layer, untied embedding and head).
_MAXTEXT_SHAPE = dict(vocab_size=256, d_model=128, num_layers=4, num_heads=4, d_ff=512)
_MAXTEXT_DEVICES, _MAXTEXT_PER_DEVICE_BATCH = 8, 4  # 8 × 4 sequences × 128 tokens = 4,096 tokens


def _config(layer_loop: str | None, attention: str | None = None):
  c = config_lib.default_config()
  c.model.size, c.model.dtype = "small", _DTYPE.value
  c.data.batch_size, c.data.seq_len = _BATCH, _SEQ
  c.mesh.data = 1
  if layer_loop is not None:  # an older checkout (the "before" run) has no layer_loop key
    c.model.layer_loop = layer_loop
  if attention is not None:  # nor a model.attention key
    c.model.attention = attention
  return c


def _trainer_setup(layer_loop=None, config=None, devices=1):
  """The Trainer's compiled data-parallel program on `devices` CPU devices (the data axis)."""
  config = config or _config(layer_loop)
  trainer = Trainer(config, pathlib.Path(tempfile.mkdtemp()) / "w", devices=jax.devices()[:devices])
  state = trainer.init_state()
  program, _ = trainer.program(None, state)
  b, t = config.data.batch_size, config.data.seq_len
  batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (1, b, t + 1), dtype=np.int32),
                         trainer.batch_sharding())
  run = lambda s: program(s, batch)[0]
  return {"run": run, "state": run(run(state)), "trainer": trainer}  # twice: the output's types


def _plain_setup(trainer):
  """value_and_grad + the same optax transformation, jitted by hand."""
  c = trainer.config
  tx = inner.make_optimizer(c.optimizer, c.num_steps)
  graphdef, params = trainer.graphdef, jax.device_get(trainer.init_state().params)
  params = jax.tree.map(lambda a: a[0], params)  # the Trainer's state has a replica axis (here 1)

  @functools.partial(jax.jit, donate_argnums=0)  # the state is updated in place, as the Trainer's
  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: loss_lib.lm_loss(graphdef, p, batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (_BATCH, _SEQ + 1),
                                                           dtype=np.int32),
                         jax.devices()[0])
  params = jax.device_put(params, jax.devices()[0])
  run = lambda s: step(s, batch)[:2]
  # Twice, so a retrace on the step's own output types happens before any timing.
  return {"run": run, "state": run(run((params, tx.init(params))))}


def _diloco_config(attention=None):
  c = _config(None, attention)
  c.algorithm, c.num_replicas, c.outer.sync_every = "diloco", _K, _H
  c.data.batch_size, c.mesh.replica, c.mesh.data = _DILOCO_BATCH, _K, 1
  c.num_steps = 100_000  # the schedule's length only; steps are run by hand
  return c


def _diloco_setup(attention=None):
  """Our DiLoCo: the Trainer's phase programs (inner steps, and the sync step every H), K
  devices."""
  c = _diloco_config(attention)
  trainer = Trainer(c, pathlib.Path(tempfile.mkdtemp()) / "w", devices=jax.devices()[:_K])
  batch = jax.device_put(
      np.random.default_rng(0).integers(0, 256, (_K, _DILOCO_BATCH, _SEQ + 1), dtype=np.int32),
      trainer.batch_sharding())
  setup = {"trainer": trainer, "step": 0}

  def run(state):
    setup["step"] += 1
    program, _ = trainer.program(trainer.algorithm.phase_at(setup["step"]), state)
    return program(state, batch)[0]

  setup["run"] = run
  state = trainer.init_state()
  for _ in range(_H):  # one whole period: compiles the inner and the sync program
    state = run(state)
  setup["state"] = state
  return setup


class Peer:
  """A peer's benchmark script as a long-lived subprocess in its own venv (benchmarks/peers/).

  The script prints one JSON object per line: {"ready": ...} once warmed up, then one
  {"cpu_seconds", "wall_seconds", ...} per `run N` command read from stdin.
  """

  def __init__(self, name, python, script, args):
    self.name, self.ready, self.skipped = name, None, None
    if not pathlib.Path(python).exists():
      self.skipped = f"{python} not found (the peer's venv is not installed here)"
      return
    self.proc = subprocess.Popen([python, str(_PEERS_DIR / script)] + args, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 bufsize=1)
    try:
      self.ready = self._read()
    except RuntimeError as e:
      self.skipped = str(e)

  def _read(self):
    deadline = time.monotonic() + _PEER_TIMEOUT.value
    while True:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
        self.close()
        raise RuntimeError(f"{self.name}: no answer within {_PEER_TIMEOUT.value} s")
      line = self.proc.stdout.readline()
      if not line:
        err = self.proc.stderr.read()[-3000:]
        raise RuntimeError(f"{self.name} exited with code {self.proc.wait()}: {err}")
      if line.startswith("{"):
        return json.loads(line)

  def run(self, steps):
    """(CPU-seconds, wall-seconds) per step of `steps` steps in the peer."""
    self.proc.stdin.write(f"run {steps}\n")
    self.proc.stdin.flush()
    r = self._read()
    return r["cpu_seconds"] / steps, r["wall_seconds"] / steps

  def close(self):
    if self.skipped is None and self.proc.poll() is None:
      try:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=120)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()


def _maxtext_pair(attention=None):
  """Our data-parallel Trainer and MaxText's train step on MaxText's CPU test shape (with
  `attention`: ours only, no peer)."""
  shape = dict(_MAXTEXT_SHAPE, seq_len=_SEQ, devices=_MAXTEXT_DEVICES,
               per_device_batch=_MAXTEXT_PER_DEVICE_BATCH)
  cfg = ModelConfig(**_MAXTEXT_SHAPE, max_seq_len=2 * _SEQ, dtype=_DTYPE.value)
  shape["params"] = param_count(cfg)
  # A named preset, so that the Trainer builds this shape from its config as for any other size.
  model_config.PRESETS.setdefault("maxtext_cpu_test", cfg)
  c = _config(None, attention)
  c.model.size = "maxtext_cpu_test"
  c.data.batch_size = _MAXTEXT_DEVICES * _MAXTEXT_PER_DEVICE_BATCH
  c.mesh.data = _MAXTEXT_DEVICES
  peer = None if attention else Peer(
      "maxtext", _MAXTEXT_PYTHON.value, "maxtext_step.py",
      [f"--{k}={v}" for k, v in shape.items() if k != "params"] + [f"--dtype={_DTYPE.value}"])
  return {"setup": _trainer_setup(config=c, devices=_MAXTEXT_DEVICES), "peer": peer,
          "tokens": c.data.batch_size * _SEQ, "flops_per_token": flops_per_token(cfg, _SEQ),
          "shape": shape}


def _diloco_processes(name, attention=None):
  """Our DiLoCo as torchft lays it out: K processes, a replica and a core each (peers/ours_...)."""
  return Peer(name, sys.executable, "ours_diloco_processes.py",
              [f"--config_json={_diloco_config(attention).to_json()}", f"--replicas={_K}",
               f"--sync_every={_H}"])


def _torchft_peer(model_cfg):
  m = model_cfg
  return Peer("torchft", _TORCHFT_PYTHON.value, "torchft_diloco.py", [
      f"--vocab_size={m.vocab_size}", f"--d_model={m.d_model}", f"--num_layers={m.num_layers}",
      f"--num_heads={m.num_heads}", f"--d_ff={m.d_ff}", f"--seq_len={_SEQ}",
      f"--batch={_DILOCO_BATCH}", f"--replicas={_K}", f"--sync_every={_H}", f"--warmup={_H}"])


def _time_round(setup, steps):
  state = setup["state"]
  jax.block_until_ready(state)
  cpu, wall = time.process_time(), time.perf_counter()
  for _ in range(steps):
    state = setup["run"](state)
  jax.block_until_ready(state)
  setup["state"] = state
  return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def _chart(rates: dict, peers: set, path: pathlib.Path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = list(rates)
  fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.2))
  ax.barh(names, [rates[n] for n in names],
          color=["tab:orange" if n in peers else "tab:blue" for n in names])
  ax.invert_yaxis()
  ax.set_xlabel("tokens per process CPU-second (median of rounds); orange: peers", fontsize=9)
  ax.set_title(f"{_DTYPE.value}; pairs (ours, peer): the same model and tokens per step",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def _ratio(cpu, tokens, ours, theirs):
  """Median over rounds of our tokens per CPU-second ÷ the peer's (None when the peer did not
  run)."""
  if not cpu.get(theirs):
    return None
  return statistics.median((tokens[ours] / a) / (tokens[theirs] / b)
                           for a, b in zip(cpu[ours], cpu[theirs]))


def main(argv):
  del argv
  trainer_setup = _trainer_setup()
  model_cfg = trainer_setup["trainer"].model_cfg
  has_layer_loop = "layer_loop" in trainer_setup["trainer"].config.model
  setups = {"trainer": trainer_setup, "plain jit": _plain_setup(trainer_setup["trainer"])}
  if has_layer_loop:
    setups["trainer, layer_loop=scan"] = _trainer_setup("scan")
  if _KERNEL:  # model.attention="cpu_kernel" (cpu_kernels/attention.py) beside the default
    setups[f"trainer{_KERNEL}"] = _trainer_setup(config=_config(None, "cpu_kernel"))
  steps = {k: _STEPS.value for k in setups}
  tokens = {k: _BATCH * _SEQ for k in setups}
  fpt = {k: flops_per_token(model_cfg, _SEQ) for k in setups}

  for suffix, attention in _ATTENTIONS.items():
    name = f"diloco K=2{suffix}"
    setups[name] = _diloco_setup(attention)
    steps[name], tokens[name], fpt[name] = _H, _K * _DILOCO_BATCH * _SEQ, fpt["trainer"]
  peers = {"torchft diloco K=2": _torchft_peer(model_cfg)}
  steps["torchft diloco K=2"] = _H
  # ours again, run like a peer: one process per replica (not a peer: blue in the chart)
  ours_as_peers = {
    f"diloco K=2 processes{suffix}": _diloco_processes(f"diloco K=2 processes{suffix}", attention)
    for suffix, attention in _ATTENTIONS.items()
  }
  for name in ours_as_peers:
    steps[name], tokens[name] = _H, _K * _DILOCO_BATCH * _SEQ
  peers.update(ours_as_peers)
  maxtext_pair = _maxtext_pair()
  if maxtext_pair["setup"] is not None:
    setups["dp, MaxText shape"] = maxtext_pair["setup"]
    steps["dp, MaxText shape"] = _STEPS.value
    tokens["dp, MaxText shape"] = tokens["maxtext"] = maxtext_pair["tokens"]
    fpt["dp, MaxText shape"] = maxtext_pair["flops_per_token"]
    if _KERNEL:
      name = f"dp, MaxText shape{_KERNEL}"
      setups[name] = _maxtext_pair("cpu_kernel")["setup"]
      steps[name], tokens[name], fpt[name] = (_STEPS.value, maxtext_pair["tokens"],
                                              maxtext_pair["flops_per_token"])
  peers["maxtext"] = maxtext_pair["peer"]
  steps["maxtext"] = _STEPS.value
  for name, peer in peers.items():
    if peer.ready:
      tokens[name] = peer.ready.get("tokens_per_step", tokens.get(name))
      print(f"{name} ready: {peer.ready}")
    else:
      print(f"{name} skipped: {peer.skipped}")

  cpu = {k: [] for k in list(setups) + list(peers)}
  wall = {k: [] for k in cpu}
  peaks = []
  try:
    for r in range(-_WARMUP_ROUNDS.value, _ROUNDS.value):  # r < 0: warm-up, not recorded
      timed = {}
      for name, s in setups.items():
        timed[name] = _time_round(s, steps[name])
      for name, peer in peers.items():
        if peer.skipped is None:
          try:
            timed[name] = peer.run(steps[name])
          except RuntimeError as e:  # a peer that dies mid-run is reported, not fatal
            peer.skipped = f"failed in round {r + 1}: {e}"
            cpu[name], wall[name] = [], []
      print(f"{f'round {r + 1}' if r >= 0 else 'warm-up round'}: "
            + ", ".join(f"{k} {1e3 * c:.0f}" for k, (c, _) in timed.items()) + " CPU-ms per step",
            flush=True)
      if r < 0:
        continue
      for name, (c, w) in timed.items():
        cpu[name].append(c)
        wall[name].append(w)
      peaks.append(mfu.measure_host_peak().flops_per_cpu_second)
  finally:
    for peer in peers.values():
      peer.close()
  cpu = {k: v for k, v in cpu.items() if v}
  wall = {k: v for k, v in wall.items() if v}

  per_round = lambda a, b: statistics.median(x / y for x, y in zip(cpu[a], cpu[b]))
  rates = {k: tokens[k] / statistics.median(v) for k, v in cpu.items()}
  mfu_median = lambda name: statistics.median(mfu.cpu_mfu(tokens[name] * fpt[name], c, p)
                                              for c, p in zip(cpu[name], peaks))
  peer_info = {}
  for name, peer in peers.items():
    peer_info[name] = ({"ran": True, **peer.ready} if peer.skipped is None
                       else {"ran": False, "reason": peer.skipped})
  result = {
      "model": "small", "dtype": _DTYPE.value, "tokens_per_step": tokens, "flops_per_token": fpt,
      "jax": jax.__version__, "rounds": _ROUNDS.value, "warmup_rounds": _WARMUP_ROUNDS.value,
      "steps_per_round": steps,
      "cpu_seconds_per_step": {k: statistics.median(v) for k, v in cpu.items()},
      "wall_seconds_per_step": {k: statistics.median(v) for k, v in wall.items()},
      "tokens_per_cpu_second": rates,
      "overhead_vs_plain_jit": per_round("trainer", "plain jit"),
      "host_matmul_flops_per_cpu_second": statistics.median(peaks),
      "mfu_small": mfu_median("trainer"),
      "mfu_small_cpu_kernel": mfu_median(f"trainer{_KERNEL}") if _KERNEL else None,
      "torchft_ratio": _ratio(cpu, tokens, "diloco K=2", "torchft diloco K=2"),
      "maxtext_ratio": _ratio(cpu, tokens, "dp, MaxText shape", "maxtext"),
      # the same three with model.attention="cpu_kernel" (a documented option, not the default)
      "torchft_ratio_cpu_kernel": _ratio(cpu, tokens, f"diloco K=2{_KERNEL}", "torchft diloco K=2"),
      # our DiLoCo with one process per replica, as torchft runs (peers/ours_diloco_processes.py)
      "torchft_ratio_processes": _ratio(cpu, tokens, "diloco K=2 processes", "torchft diloco K=2"),
      "torchft_ratio_processes_cpu_kernel": _ratio(cpu, tokens, f"diloco K=2 processes{_KERNEL}",
                                                   "torchft diloco K=2"),
      "maxtext_ratio_cpu_kernel": _ratio(cpu, tokens, f"dp, MaxText shape{_KERNEL}", "maxtext"),
      "cpu_kernel_over_xla": (per_round(f"trainer{_KERNEL}", "trainer") if _KERNEL else None),
      "peers": peer_info,
      "diloco": {"K": _K, "H": _H, "sequences_per_replica": _DILOCO_BATCH, "seq_len": _SEQ,
                 "model": dataclasses.asdict(model_cfg)},
      "maxtext_shape": maxtext_pair["shape"],
      "cpu_seconds_per_round": cpu, "host_peak_per_round": peaks,
  }
  if has_layer_loop:
    result["scan_over_unrolled"] = per_round("trainer, layer_loop=scan", "trainer")
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  _chart(rates, set(peers) - set(ours_as_peers), out.with_suffix(".png"))
  print(f"{'setup':<28}{'CPU ms/step':>12}{'wall ms/step':>13}{'tokens/CPU-s':>14}")
  for k in cpu:
    print(f"{k:<28}{1e3 * result['cpu_seconds_per_step'][k]:>12.1f}"
          f"{1e3 * result['wall_seconds_per_step'][k]:>13.1f}{rates[k]:>14.0f}")
  print(f"overhead vs plain jit {result['overhead_vs_plain_jit']:.3f}; MFU (CPU-seconds) "
        f"{result['mfu_small']:.3f} of {result['host_matmul_flops_per_cpu_second'] / 1e9:.1f} "
        f"GFLOP per CPU-second; torchft_ratio {result['torchft_ratio']}; "
        f"maxtext_ratio {result['maxtext_ratio']}; with model.attention=cpu_kernel: "
        f"torchft_ratio {result['torchft_ratio_cpu_kernel']}, "
        f"maxtext_ratio {result['maxtext_ratio_cpu_kernel']}, step "
        f"CPU-s {result['cpu_kernel_over_xla']} of the default's; one process per replica: "
        f"torchft_ratio {result['torchft_ratio_processes']}, with "
        f"cpu_kernel {result['torchft_ratio_processes_cpu_kernel']}; wrote {out}")


if __name__ == "__main__":
  app.run(main)
