"""Helpers the tests share (no test file imports another test file); also for users testing their
own configs: tiny run configs, the engine battery's cases, run outputs, HLO collective bytes,
launch_local.py runs of several processes, reading a run's final state back, hashing a directory.

Multi-process runs:

Each process has one fake CPU device and owns whole replicas; the single-process reference
simulates the same replicas with vmap on one device. All-reduce order differs between the two
(gloo across processes, an XLA reduction inside one), so parameters agree to float32 rounding:
max abs difference below TOLERANCE (the differences measured are in
benchmarks/results/README.md, "Multi-process agreement"). The launched processes run with XLA's
expensive optimizations off (JAX_DISABLE_MOST_OPTIMIZATIONS): every process but the first compiles
each program itself (JAX writes the persistent compilation cache from process 0 only), and this
halves that time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import ipaddress
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from lowcomm_jax import config as config_lib
from lowcomm_jax.train import Trainer, hooks

# -- run configs and outputs (the engine battery, tests/test_engine.py) ---------------------------


def tiny_config(**changes) -> ml_collections.ConfigDict:
  """The `tiny` model on 8 × 64 bytes per step, 40 steps, logging every step, no bar."""
  c = config_lib.default_config()
  config_lib.override(c, {
      "model.size": "tiny", "num_steps": 40, "data.seq_len": 64, "data.batch_size": 8,
      "eval.batch_size": 8, "eval.num_batches": 4, "eval.every": 1000, "checkpoint.every": 1000,
      "log_every": 1, "progress_bar": False, "hardware.peak_flops_per_device": 1e10})
  return config_lib.override(c, changes)


def engine_config(case: str, **changes) -> ml_collections.ConfigDict:
  """A 6-step run of battery case `case` (ENGINE_CASES) on 32-byte windows, 4 per replica."""
  base = {"num_steps": 6, "data.seq_len": 32, "data.batch_size": 4, "eval.batch_size": 4,
          "eval.num_batches": 2, "eval.every": 3, "checkpoint.every": 2,
          "optimizer.warmup_steps": 2,
          "mesh.data": 1}
  return tiny_config(**{**base, **ENGINE_CASES[case]["config"], **changes})


_PIPELINE = {"gradients": "pipeline", "num_replicas": 2, "mesh.replica": 2, "mesh.stage": 2,
             "pipeline.num_routings": 2, "optimizer.name": "adam", "optimizer.grad_clip": 0.0}

# Every algorithm and gradient source the one Trainer runs. "sync": the first step with an outer
# step (its metrics are computed before it; the step after shows its effect).
ENGINE_CASES = {
    "dp": {"config": {}, "sync": 1},
    "diloco": {"config": {"algorithm": "diloco", "num_replicas": 2, "outer.sync_every": 3},
               "sync": 3},
    "streaming_diloco": {"config": {
        "algorithm": "streaming_diloco", "num_replicas": 2, "outer.num_fragments": 2,
        "outer.non_block_fragment": "fold", "outer.sync_every": 4, "outer.overlap_steps": 1,
        "outer.merge_alpha": 0.5}, "sync": 3},
    "noloco": {"config": {"algorithm": "noloco", "num_replicas": 4, "noloco.sync_every": 3,
                          "noloco.num_groupings": 2}, "sync": 3},
    # Streaming DiLoCo's case with SparseLoCo's sparse gather (chunks of 64, 4 kept, 2 bits)
    "sparseloco": {"config": {
        "algorithm": "sparseloco", "num_replicas": 2, "outer.num_fragments": 2,
        "outer.non_block_fragment": "fold", "outer.sync_every": 4,
        "outer.overlap_steps": 1, "outer.merge_alpha": 0.5, "sparseloco.chunk_size": 64,
        "sparseloco.top_k": 4}, "sync": 3},
    "skippipe": {"config": {"gradients": "skippipe", "pipeline.num_stages": 4,
                            "skippipe.paths": "0-1-2,0-2-3,0-3-1,0-1-3"}, "sync": 1},
    "pipeline_noloco": {"config": {**_PIPELINE, "algorithm": "noloco", "noloco.sync_every": 3,
                                   "noloco.num_groupings": 2}, "sync": 3},
    "pipeline_diloco": {"config": {**_PIPELINE, "algorithm": "diloco", "outer.sync_every": 3,
                                   "outer_optimizer.momentum": 0.3}, "sync": 3},
    # SparseLoCo over the other two sources. Chunks of 32 (2 kept) divide every layer's leaf of the
    # tiny model, so a stage's slice of a leaf is whole chunks and the pipeline's top-k picks what
    # the replicas source's picks; SkipPipe on identity paths (each micro-batch through stages 0,
    # 1).
    "pipeline_sparseloco": {"config": {**_PIPELINE, "algorithm": "sparseloco",
                                       "outer.sync_every": 3, "sparseloco.chunk_size": 32,
                                       "sparseloco.top_k": 2}, "sync": 3},
    "skippipe_sparseloco": {"config": {
        "gradients": "skippipe", "pipeline.num_stages": 2, "skippipe.paths": "0-1,0-1,0-1,0-1",
        "algorithm": "sparseloco", "num_replicas": 2, "outer.sync_every": 3,
        "sparseloco.chunk_size": 32, "sparseloco.top_k": 2}, "sync": 3},
}
# Compositions of an algorithm and a gradient source each proven on its own in the battery: the
# equivalences (one device = the mesh, ledger = compiled collectives) cover them, not the goldens.
COMPOSED_CASES = ("pipeline_sparseloco", "skippipe_sparseloco")


# The battery's two-process leg (tests/test_engine.py, tests/engine_processes_worker.py): each
# algorithm with one replica per process, changes on top of engine_config. Not dp: processes split
# the `replica` axis only (`distributed.check_mesh`; the inner axes stay inside one process), and
# dp has one replica. Streaming DiLoCo and SparseLoCo (τ = 1) exchange on the overlap thread.
PROCESS_CASES = {"diloco": {}, "streaming_diloco": {},
                 "noloco": {"num_replicas": 2, "noloco.num_groupings": 1}, "sparseloco": {}}


def process_leg_config(case: str, num_processes: int = 1) -> ml_collections.ConfigDict:
  """The config of PROCESS_CASES[case] spread over `num_processes` one-device processes (1: the
  one-device reference, replicas simulated with vmap). No eval or checkpoint but the final one."""
  c = engine_config(case, **{"eval.every": 1000, "checkpoint.every": 1000, **PROCESS_CASES[case]})
  if num_processes > 1:
    config_lib.override(c, {"mesh.replica": num_processes, "distributed.timeout_seconds": 30})
  return c


# tests/test_overlap_loop.py's two-process leg: Streaming DiLoCo (P = 2, H = 6, α = 0.5, 8 steps)
# with one replica per process, by τ and codec keys, each run under both overlap executors; all in
# one launch of tests/engine_processes_worker.py --leg=overlap: the e3m0 codec with error feedback
# (the residual travels back from the thread into the state) at τ = 2. float32 at τ = 1 on the
# thread across two processes is test_engine's two-process Streaming DiLoCo case.
OVERLAP_PROCESS_RUNS = {"tau2-e3m0-ef": (2, {"outer.codec": "e3m0",
                                             "outer.error_feedback": True})}
OVERLAP_EXECUTORS = ("inline", "thread")


def overlap_leg_configs(num_processes: int = 2) -> dict[str, ml_collections.ConfigDict]:
  """The configs of OVERLAP_PROCESS_RUNS × OVERLAP_EXECUTORS, keyed `<run>-<executor>` (the run
  directory's name), as experiments/configs/diloco.py:tiny with these changes."""
  configs = {}
  for run, (tau, codec) in OVERLAP_PROCESS_RUNS.items():
    changes = multiprocess_changes(num_processes, {
        **STREAMING, "num_steps": 8, "outer.sync_every": 6, "outer.overlap_steps": tau, **codec})
    for mode in OVERLAP_EXECUTORS:
      configs[f"{run}-{mode}"] = make_config("diloco.py",
                                             {**changes, "outer.overlap_executor": mode})
  return configs


def read_metrics(workdir) -> list[dict]:
  return [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


_DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1,
                "f64": 8, "s64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


def collective_bytes(line: str) -> int:
  """Bytes of a collective's result in one HLO instruction line (all its tuple elements)."""
  result = (
    line.split("=", 1)[1].split("(", 1)[0]
    if "= (" not in line
    else line.split("= (", 1)[1].split(")", 1)[0]
  )
  total = 0
  for dtype, dims in _SHAPE.findall(result):
    size = 1
    for d in filter(None, dims.split(",")):
      size *= int(d)
    total += size * _DTYPE_BYTES[dtype]
  return total


# -- multi-process runs and run directories (tests/test_multiprocess_*, test_bad_inputs) ----------

ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository (an editable install)
LAUNCHER = ROOT / "experiments" / "launch_local.py"


def launcher_module():
  """experiments/launch_local.py as a module, loaded once per process: its absl flags are defined
  when it is executed, and a second execution in the same process would define them twice."""
  module = sys.modules.get("launch_local")
  if module is None:
    spec = importlib.util.spec_from_file_location("launch_local", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["launch_local"] = module
    spec.loader.exec_module(module)
  return module
CONFIGS = ROOT / "experiments" / "configs"
TOLERANCE = 1e-5

COMMON = {"model.size": "tiny", "num_steps": 8, "outer.sync_every": 4, "data.seq_len": 32,
          "data.batch_size": 4, "eval.batch_size": 4, "eval.num_batches": 1, "eval.every": 1000,
          "checkpoint.every": 1000, "log_every": 1, "progress_bar": False,
          "hardware.peak_flops_per_device": 1e10, "distributed.timeout_seconds": 20}
STREAMING = {"algorithm": "streaming_diloco", "outer.num_fragments": 2,
             "outer.non_block_fragment": "fold", "outer.overlap_steps": 1,
             "outer.merge_alpha": 0.5, "num_steps": 12}


def tree_hash(directory) -> dict[str, str]:
  """SHA-256 of every file under `directory` by relative path ({} when it does not exist)."""
  root = pathlib.Path(directory)
  if not root.exists():
    return {}
  if root.is_file():
    return {"": hashlib.sha256(root.read_bytes()).hexdigest()}
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(root.rglob("*")) if p.is_file()}


def tree_state(directory) -> dict[str, tuple]:
  """(mode, size, mtime in ns, SHA-256 of a file's bytes) of `directory` itself ("."; through a
  symbolic link) and of everything under it, by relative path: what a tool that only reads leaves
  as it was."""
  root = pathlib.Path(directory)
  if not root.exists():
    return {}
  state = {}
  for path in [root, *sorted(root.rglob("*"))]:
    info = path.stat() if path == root else path.lstat()
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    state[str(path.relative_to(root))] = (info.st_mode, info.st_size, info.st_mtime_ns, digest)
  return state


def file_module(path, name: str):
  """The Python file at `path` executed as a module named `name` (a script or config file)."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def make_config(config_file: str, changes: dict):
  module = file_module(CONFIGS / config_file, "experiment_config")
  return config_lib.override(module.get_config("tiny"), changes)


def launch(num_processes: int, workdir, changes: dict, on_line=None,
           config_file: str = "diloco.py", extra_flags=()) -> subprocess.CompletedProcess:
  """Runs train.py through launch_local.py to the end; `on_line(line, popen)` sees each line of
  its stdout."""
  return launch_script(num_processes,
                       [f"--config={CONFIGS / config_file}:tiny", f"--workdir={workdir}",
                                       *(f"--config.{k}={v}" for k, v in changes.items()),
                                       *extra_flags], on_line)


def launch_script(num_processes: int, args, on_line=None,
                  script=None) -> subprocess.CompletedProcess:
  """Runs `script` (default train.py) with `args` as `num_processes` processes of
  launch_local.py."""
  command = [sys.executable, str(LAUNCHER), f"--num_processes={num_processes}",
             *([f"--script={script}"] if script else []), "--", *map(str, args)]
  popen = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1"))
  stderr = []
  pump = threading.Thread(target=lambda: stderr.extend(popen.stderr), daemon=True)
  pump.start()
  stdout = []
  for line in popen.stdout:
    stdout.append(line)
    if on_line:
      on_line(line, popen)
  popen.wait(timeout=240)
  pump.join(timeout=10)
  return subprocess.CompletedProcess(command, popen.returncode, "".join(stdout), "".join(stderr))


def multiprocess_changes(num_processes: int, changes: dict) -> dict:
  return {**COMMON, "num_replicas": num_processes, "mesh.replica": num_processes, **changes}


def restored(workdir):
  """The final train state of a run directory, read back from its orbax checkpoint."""
  return Trainer(config_lib.load_run_config(workdir), workdir).restore_latest()


def max_abs_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def assert_states_within(actual, expected, num_steps: int, terms_per_step: int,
                         what: str = "state") -> None:
  """Two Trainer states of float32 trajectories that round apart (two carriers, two layouts):
  every leaf within `trajectory_error_bound` at its own scale, except the trees of outer gradients
  (the comm state's in-flight means and error-feedback residuals, eager's own Δ). A Δ = φ − θ
  carries the rounding of φ and θ, so it is bounded at the parameters' scale, not at its own."""
  bound = lambda x: trajectory_error_bound(x, num_steps, terms_per_step) if np.size(x) else 0

  def split(state):
    opt = state.opt_state
    if not hasattr(opt, "comm"):
      return state, ()
    deltas = (opt.comm.in_flight, opt.comm.residuals, getattr(opt, "own_deltas", ()))
    rest = opt._replace(comm=opt.comm._replace(in_flight={}, residuals={}))
    if hasattr(opt, "own_deltas"):
      rest = rest._replace(own_deltas=())
    return state._replace(opt_state=rest), deltas

  (rest_a, deltas_a), (rest_b, deltas_b) = split(actual), split(expected)
  assert_trees_within(rest_a, rest_b, bound, what)
  assert_trees_within(deltas_a, deltas_b, bound(expected.params), f"{what} (outer gradients)")


def single_process(tmp_path, num_replicas: int, changes: dict, config_file: str = "diloco.py"):
  c = make_config(config_file, {**COMMON, "num_replicas": num_replicas, "mesh.replica": 1,
                                "mesh.data": 1, **changes})
  trainer = Trainer(c, tmp_path / f"single{num_replicas}", devices=jax.devices()[:1])
  return run_to_end(trainer)[1].state


def run_to_end(trainer, *more_hooks) -> tuple[dict, hooks.FinalState]:
  """(summary, the `hooks.FinalState` attached: its `state` and `data_state`) of `trainer.run`."""
  final = hooks.FinalState()
  return trainer.run(hooks=[final, *more_hooks]), final


def run_streaming_two_processes(workdir) -> None:
  """An uninterrupted 2-process Streaming DiLoCo run (P=2, τ=1, α=0.5), saved once at the end."""
  proc = launch(2, workdir, multiprocess_changes(2, STREAMING))
  assert proc.returncode == 0, proc.stderr[-3000:]


def listening_addresses(pid: int) -> list[tuple]:
  """(IP address, port) of every TCP socket process `pid` listens on (read from /proc, Linux)."""
  inodes = set()
  for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
    try:
      target = os.readlink(fd)
    except OSError:  # closed meanwhile
      continue
    if target.startswith("socket:["):
      inodes.add(target[8:-1])
  found = []
  for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for row in pathlib.Path(table).read_text().splitlines()[1:]:
      fields = row.split()
      local, state, inode = fields[1], fields[3], fields[9]
      if state != "0A" or inode not in inodes:  # 0A: LISTEN
        continue
      host, port = local.split(":")
      raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
      address = ipaddress.ip_address(raw)
      if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
      found.append((address, int(port, 16)))
  return found


# -- small problems for the optax-style transforms and codec error bounds (tests/test_diloco.py,
# test_streaming.py, test_noloco.py, test_codecs.py, test_compressed_mean.py) ----------------

REPLICA = "replica"


# Each 4/8-bit format's grid of magnitudes in units of its absmax scale, written from the formats
# (not read from the library), so that the bounds check the codecs independently.
GRIDS = {
    "e3m0": np.array([0.0] + [2.0**e for e in range(-6, 1)]),  # code 0 is zero
    "e2m1": np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]),
    "int4": np.arange(8, dtype=np.float64),
    "int8": np.arange(128, dtype=np.float64),
}
SMALLEST_NORMAL = 2.0**-126


def blocks(codec, x):
  """x as float64 ``[num_blocks, block_len]`` in the codec's layout (zero padded)."""
  flat = np.asarray(x, np.float64).reshape(-1)
  num_blocks, block_len = codec.layout(flat.size)
  out = np.zeros(num_blocks * block_len)
  out[:flat.size] = flat
  return out.reshape(num_blocks, block_len)


def error_bound(codec, x, stochastic=None):
  """Largest |decode(encode(x)) - x| per value the format allows, shaped like x."""
  x = np.asarray(x, np.float64)
  stochastic = codec.rounding == "stochastic" if stochastic is None else stochastic
  if codec.name == "fp32":
    return np.zeros_like(x)
  if codec.name == "bf16":
    gap = np.abs(x) * 2.0**-7  # 8 significant bits
    return (gap if stochastic else gap / 2) + SMALLEST_NORMAL
  grid = GRIDS[codec.name]
  x_blocks = blocks(codec, x)
  absmax = np.abs(x_blocks).max(axis=1, keepdims=True)
  scale = absmax / grid[-1]
  with np.errstate(invalid="ignore", divide="ignore"):
    units = np.where(scale > 0, np.abs(x_blocks) / np.where(scale > 0, scale, 1), 0)
  upper = np.clip(np.searchsorted(grid, units), 1, len(grid) - 1)
  gap = (grid[upper] - grid[upper - 1]) * scale
  slack = 8 * np.finfo(np.float32).eps * absmax + grid[-1] * SMALLEST_NORMAL
  bound = (gap if stochastic else gap / 2) + slack
  return bound.reshape(-1)[:x.size].reshape(x.shape)


def chunks(x, axis_size):
  """Flat x cut into the compressed mean's M chunks of ceil(n / M) values (zero padded)."""
  flat = np.asarray(x, np.float64).reshape(-1)
  chunk_len = math.ceil(flat.size / axis_size)
  out = np.zeros(axis_size * chunk_len)
  out[:flat.size] = flat
  return out.reshape(axis_size, chunk_len)


def run_replicas(tx, params, batches_r, loss_fn, use_phase=False):
  """Runs `tx` over stacked replicas with vmap; batches_r: [steps, M, ...]."""
  num_replicas = batches_r.shape[1]
  params_r, state = tx.init_replicated(params, num_replicas)

  def step(p, s, batch, phase):
    grads = jax.grad(loss_fn)(p, batch)
    updates, s = tx.update(grads, s, p, phase=phase)
    return optax.apply_updates(p, updates), s

  programs = {}
  for i, batch_r in enumerate(batches_r):
    phase = tx.phase_at(i + 1) if use_phase else None
    if phase not in programs:
      programs[phase] = jax.jit(jax.vmap(lambda p, s, b, ph=phase: step(p, s, b, ph),
                                         in_axes=(0, tx.state_axes, 0), out_axes=(0, tx.state_axes),
                                         axis_name=REPLICA))
    params_r, state = programs[phase](params_r, state, batch_r)
  return params_r, state


def mlp_problem(seed=0, steps=12, replicas=4, batch=8):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  params = {"w1": jax.random.normal(k1, (3, 5)) * 0.5, "b1": jnp.zeros((5,)),
            "w2": jax.random.normal(k2, (5, 1)) * 0.5}
  xs = jax.random.normal(k3, (steps, replicas, batch, 4))

  def loss_fn(p, xy):
    x, y = xy[..., :3], xy[..., 3:]
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

  return params, xs, loss_fn


def layered_problem(layers=4, replicas=3, steps=12, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  params = {"blocks": {"w": jax.random.normal(k[0], (layers, 3, 3)) * 0.5,
                       "b": jnp.zeros((layers, 3))},
            "head": jax.random.normal(k[1], (3, 1)) * 0.5}
  xs = jax.random.normal(k[2], (steps, replicas, 8, 4))

  def loss_fn(p, xy):
    h = xy[..., :3]
    for layer in range(layers):
      h = jnp.tanh(h @ p["blocks"]["w"][layer] + p["blocks"]["b"][layer])
    return jnp.mean((h @ p["head"] - xy[..., 3:]) ** 2)

  return params, xs, loss_fn


def streaming_config(**changes):
  base = {"algorithm": "streaming_diloco", "num_replicas": 2, "outer.sync_every": 6,
          "outer.num_fragments": 2, "outer.overlap_steps": 1, "outer.merge_alpha": 0.5}
  base.update(changes)
  return tiny_config(**base)


# The float32 error bounds, kept importable from here as the tests use them.
from lowcomm_jax.error_bounds import *  # pylint: disable=wildcard-import,unused-wildcard-import,wrong-import-position  # noqa: E402,F401,F403
