"""Training throughput and MFU of the accelerator presets on one accelerator host, and the codec
kernels' bandwidth against a copy.

  python benchmarks/accelerator.py          # a GPU or TPU host: benchmarks/results/accelerator.json
  python benchmarks/accelerator.py --smoke  # any host, tiny sizes: checks the script end to end

Training rows, for each preset of `--models` (default: the `sdl_*` presets up to 2 B parameters)
and two algorithms: `dp` (plain optax AdamW) and `streaming_diloco_e3m0` (Streaming DiLoCo, one
worker per host, P = 3 strided fragments plus the non-block one, H = 100, τ = 1, α = 0.5, outer
gradients sent as e3m0; a model whose layers 3 does not divide gets P = 2 or 1, H = 25 (P + 1)).
Every run is bfloat16, `--seq_len` tokens per sequence (2048), on a mesh of every local device
(`data` axis), with the largest per-device batch that fits: doubling from 1 until XLA reports the
device out of memory (at compile time or at the first step), or, for a preset `--batches` names,
halving from that batch until it fits. The timed steps are non-sync steps (a Streaming DiLoCo sync
step also encodes and sends a fragment), `--steps` of them after `--warmup`, in alternating rounds
with the dp setup of the same preset; a row holds the median tokens/s, the Trainer's MFU
(train/mfu.py: the chip's bf16 datasheet peak by device kind) and, for Streaming DiLoCo, its step
time over dp's.

Kernel rows, for each 4-bit and 8-bit codec and each GPU kernel of `--gpu_kernels` (on GPU; the
default is the one `codecs.kernels.gpu_kernel` picks): the compiled Pallas encode and decode (each
its own program, so the codes are really written and read) of 2^`--log2_values` float32 values,
each timed over `--calls` calls in a row; `gb_per_s` counts the float32 bytes a round trip reads
and writes (8 per value, as a copy does) over encode + decode time, and `fraction_of_copy` divides
it by a measured float32 copy of the same array. A codec whose kernel fails to compile gets a row
with its error instead of figures. `--parts` runs the training or the kernel rows alone.

On CPU only `--smoke` runs (and writes to a temporary file unless `--out` says otherwise): CPU
figures are no accelerator results.
"""

from __future__ import annotations

import functools
import json
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from lowcomm_jax import codecs, config as config_lib
from lowcomm_jax.models import PRESETS, config as model_config, flops_per_token
from lowcomm_jax.train import Trainer, mfu

RESULTS = pathlib.Path(__file__).parent / "results" / "accelerator.json"

_MODELS = flags.DEFINE_list("models", None,
                            "Presets to train (default: sdl_* up to 2 B parameters).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating timed rounds per preset.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps after compiling.")
_MAX_BATCH = flags.DEFINE_integer("max_batch_per_device", 256, "Largest per-device batch tried.")
_ATTENTION = flags.DEFINE_string("attention", None, "model.attention (default: the config's).")
_REMAT = flags.DEFINE_string("remat", None, "model.remat (default: the config's).")
_LOG2_VALUES = flags.DEFINE_integer("log2_values", 28,
                                    "log2 of the float32 values the codecs code.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Interleaved timings per kernel program.")
_CALLS = flags.DEFINE_integer("calls", 10, "Calls in a row per kernel timing.")
_BATCHES = flags.DEFINE_list("batches", [], "model=batch: the per-device batch to try first for a "
                             "preset (halved until it fits) instead of doubling from 1.")
_GPU_KERNELS = flags.DEFINE_list("gpu_kernels", None, "GPU kernels of the kernel rows (mosaic_gpu, "
                                 "triton; default: the one codecs.kernels.gpu_kernel picks).")
_PARTS = flags.DEFINE_list("parts", ["training", "kernels"], "Which rows: training, kernels.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny sizes on any backend, to check the script runs.")
_OUT = flags.DEFINE_string("out", None, f"Where to write the results (default {RESULTS}; with "
                           "--smoke a temporary file).")

KERNEL_CODECS = ("e3m0", "e2m1", "int4", "int8")
STREAMING = {"algorithm": "streaming_diloco", "num_replicas": 1, "outer.sync_every": 100,
             "outer.num_fragments": 3, "outer.fragment_pattern": "strided",
             "outer.overlap_steps": 1, "outer.merge_alpha": 0.5, "outer.codec": "e3m0"}
ALGORITHMS = {"dp": {}, "streaming_diloco_e3m0": STREAMING}


def default_models() -> list[str]:
  return [name for name, cfg in PRESETS.items()
          if name.startswith("sdl") and model_config.param_count(cfg) <= 2e9]


def out_of_memory(error: Exception) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def run_config(model: str, algorithm: str, batch_per_device: int, seq_len: int):
  """The config of one training row on every local device."""
  devices = jax.local_device_count()
  c = config_lib.default_config()
  config_lib.override(c, {
      "model.size": model, "model.dtype": "bfloat16", "data.seq_len": seq_len,
      "data.batch_size": batch_per_device * devices, "eval.batch_size": batch_per_device * devices,
      "mesh.replica": 1, "mesh.data": -1, "progress_bar": False, **ALGORITHMS[algorithm]})
  if c.algorithm == "streaming_diloco":  # P = 3 divides every preset's layers; 2 or 1 for others
    layers = model_config.get_model_config(model).num_layers
    c.outer.num_fragments = next(p for p in (3, 2, 1) if layers % p == 0)
    c.outer.sync_every = 25 * (c.outer.num_fragments + 1)
  if _ATTENTION.value is not None:
    c.model.attention = _ATTENTION.value
  if _REMAT.value is not None:
    if "remat" not in c.model:
      raise app.UsageError("--remat: this version has no model.remat")
    c.model.remat = _REMAT.value
  return c


class Setup:
  """One compiled non-sync step with its state and a batch, ready to time."""

  def __init__(self, c, workdir: pathlib.Path):
    self.config, self.trainer = c, Trainer(c, workdir, devices=jax.local_devices())
    self.state = self.trainer.init_state()
    self.program, _ = self.trainer.program(self.trainer.algorithm.phase_at(1), self.state)
    shape = (c.num_replicas, c.data.batch_size, c.data.seq_len + 1)
    vocab = min(256, self.trainer.model_cfg.vocab_size)
    tokens = np.random.default_rng(0).integers(0, vocab, shape, dtype=np.int32)
    self.batch = jax.device_put(tokens, self.trainer.batch_sharding())
    self.steps(1)  # the first step allocates everything: an out-of-memory shows here at the latest
    self.seconds: list[float] = []
    self.cpu_seconds: list[float] = []

  def steps(self, n: int) -> None:
    for _ in range(n):
      self.state, _ = self.program(self.state, self.batch)
    jax.block_until_ready(self.state)

  def time(self, n: int) -> None:
    start, cpu = time.perf_counter(), time.process_time()
    self.steps(n)
    self.seconds.append(time.perf_counter() - start)
    self.cpu_seconds.append(time.process_time() - cpu)


def largest_fitting(model: str, algorithm: str, root: pathlib.Path) -> Setup:
  """The setup of the largest per-device batch (1, 2, 4, ...) that compiles and runs, or the first
  of the `--batches` guess, its half, ... that does."""
  guesses = dict(item.split("=") for item in _BATCHES.value)
  if model in guesses:
    batch = int(guesses[model])
    while batch >= 1:
      try:
        return Setup(run_config(model, algorithm, batch, _SEQ_LEN.value),
                     root / f"{model}_{algorithm}_{batch}")
      except Exception as error:  # pylint: disable=broad-except
        if not out_of_memory(error):
          raise
      batch //= 2
    raise SystemExit(f"{model} {algorithm}: a batch of 1 per device does not fit")
  best = None
  batch = 1
  while batch <= _MAX_BATCH.value:
    try:
      Setup(run_config(model, algorithm, batch, _SEQ_LEN.value),
            root / f"{model}_{algorithm}_{batch}")
    except Exception as error:  # pylint: disable=broad-except
      if not out_of_memory(error):
        raise
      break
    best, batch = batch, batch * 2
  if best is None:
    raise SystemExit(f"{model} {algorithm}: a batch of 1 per device does not fit")
  return Setup(run_config(model, algorithm, best, _SEQ_LEN.value), root / f"{model}_{algorithm}")


def training_rows(root: pathlib.Path) -> list[dict]:
  rows = []
  devices = jax.local_devices()
  for model in _MODELS.value or default_models():
    setups = {}
    for algorithm in ALGORITHMS:
      setups[algorithm] = largest_fitting(model, algorithm, root)
      setups[algorithm].steps(_WARMUP.value)
    for _ in range(_ROUNDS.value):
      for setup in setups.values():
        setup.time(_STEPS.value)
    dp_step = statistics.median(setups["dp"].seconds) / _STEPS.value
    for algorithm, setup in setups.items():
      c, trainer = setup.config, setup.trainer
      tokens = _STEPS.value * c.num_replicas * c.data.batch_size * c.data.seq_len
      wall, cpu = statistics.median(setup.seconds), statistics.median(setup.cpu_seconds)
      peak = mfu.run_peak(c.hardware.peak_flops_per_device, len(devices), devices)
      flops = tokens * flops_per_token(trainer.model_cfg, c.data.seq_len)
      row = dict(model=model, algorithm=algorithm, params=trainer.num_params,
                 tokens_per_s=tokens / wall, mfu=peak.mfu(flops, wall, cpu), mfu_clock=peak.clock,
                 step_s=wall / _STEPS.value, step_over_dp=wall / _STEPS.value / dp_step,
                 batch_per_device=c.data.batch_size // len(devices), seq_len=c.data.seq_len,
                 dtype=c.model.dtype, attention=c.model.attention,
                 remat=c.model.get("remat", "none"), layer_loop=c.model.layer_loop,
                 codec_kernel=trainer.codec_kernel, device_kind=devices[0].device_kind,
                 devices=len(devices))
      rows.append(row)
      print(f"{model:<10} {algorithm:<22} batch {row['batch_per_device']:>4}/device  "
            f"{row['tokens_per_s']:>12.0f} tokens/s  MFU {row['mfu']:.3f}  "
            f"step/dp {row['step_over_dp']:.3f}", flush=True)
    del setups
  return rows


def _seconds(fn, x, calls: int) -> float:
  """Seconds per call of `calls` calls in a row (dispatch overlapping the device's work)."""
  jax.block_until_ready(x)
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(x)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def kernel_rows() -> list[dict]:
  n = 1 << _LOG2_VALUES.value
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  copy = jax.jit(lambda a: a + 0)  # reads and writes every value once, as a copy
  programs = {"copy": (copy, x)}
  errors = {}
  on_gpu = jax.devices()[0].platform == "gpu"
  gpus = (_GPU_KERNELS.value or [codecs.kernels.gpu_kernel()]) if on_gpu else [None]
  cases = [(name, gpu) for gpu in gpus for name in KERNEL_CODECS]
  for name, gpu in cases:
    codec = codecs.get_codec(name)
    try:
      options = dict(use_pallas=True, gpu=gpu)
      encode = jax.jit(functools.partial(codec.encode, **options))
      encoded = jax.block_until_ready(encode(x))
      decode = jax.jit(functools.partial(codec.decode, **options))
      jax.block_until_ready(decode(encoded))
    except Exception as error:  # pylint: disable=broad-except
      errors[name, gpu] = _first_line(error)
      continue
    programs[name, gpu, "encode"], programs[name, gpu, "decode"] = (encode, x), (decode, encoded)
  jax.block_until_ready(copy(x))
  times = {key: [] for key in programs}
  for _ in range(_REPEATS.value):  # interleaved, so a slow moment hits every program alike
    for key, (fn, arg) in programs.items():
      times[key].append(_seconds(fn, arg, _CALLS.value))
  median = {key: statistics.median(ts) for key, ts in times.items()}
  copy_gb_per_s = 8 * n / median["copy"] / 1e9
  device_kind = jax.devices()[0].device_kind
  rows = [dict(codec="copy", gb_per_s=copy_gb_per_s, fraction_of_copy=1.0, seconds=median["copy"],
               device_kind=device_kind)]
  for name, gpu in cases:
    kernel = codecs.kernel_choice("pallas", codecs.get_codec(name),
                                  "cuda" if on_gpu else jax.devices()[0].platform) if gpu is None \
        else f"pallas_{gpu}"
    if (name, gpu) in errors:
      rows.append(dict(codec=name, kernel=kernel, error=errors[name, gpu], device_kind=device_kind))
      continue
    seconds = median[name, gpu, "encode"] + median[name, gpu, "decode"]
    gb_per_s = 8 * n / seconds / 1e9
    rows.append(dict(codec=name, kernel=kernel, gb_per_s=gb_per_s,
                     fraction_of_copy=gb_per_s / copy_gb_per_s,
                     encode_s=median[name, gpu, "encode"], decode_s=median[name, gpu, "decode"],
                     device_kind=device_kind))
  for row in rows:
    figures = (f"{row['gb_per_s']:>9.1f} GB/s  {row['fraction_of_copy']:.3f} of copy"
               if "gb_per_s" in row else row["error"])
    print(f"{row['codec']:<6} {row.get('kernel', ''):<18} {figures}", flush=True)
  return rows


def main(argv):
  del argv
  platform = jax.devices()[0].platform
  if _SMOKE.value:
    flags.FLAGS.models = _MODELS.value or ["tiny"]
    for name, value in (("seq_len", 64), ("steps", 2), ("rounds", 1), ("warmup", 1),
                        ("max_batch_per_device", 2), ("log2_values", 14), ("repeats", 2),
                        ("calls", 2)):
      if not flags.FLAGS[name].present:
        flags.FLAGS[name].value = value
  elif platform == "cpu":
    sys.exit("benchmarks/accelerator.py measures GPUs and TPUs; on CPU run it with --smoke")
  out = pathlib.Path(_OUT.value) if _OUT.value else (
      pathlib.Path(tempfile.mkdtemp()) / "accelerator_smoke.json" if _SMOKE.value else RESULTS)
  if (_SMOKE.value or platform == "cpu") and out.resolve() == RESULTS.resolve():
    sys.exit(f"--out: {RESULTS} holds accelerator figures only, not --smoke or CPU ones")
  unknown = set(_PARTS.value) - {"training", "kernels"}
  if unknown:
    sys.exit(f"--parts: each of training, kernels; got {', '.join(sorted(unknown))}")
  rows = []
  if "training" in _PARTS.value:
    with tempfile.TemporaryDirectory() as root:
      rows = training_rows(pathlib.Path(root))
  result = dict(command=" ".join(["python", "benchmarks/accelerator.py", *sys.argv[1:]]),
                smoke=_SMOKE.value, platform=platform, device_kind=jax.devices()[0].device_kind,
                devices=jax.local_device_count(), jax=jax.__version__, seq_len=_SEQ_LEN.value,
                steps=_STEPS.value, rounds=_ROUNDS.value, streaming_diloco=STREAMING,
                log2_values=_LOG2_VALUES.value, training=rows,
                kernels=kernel_rows() if "kernels" in _PARTS.value else [])
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
