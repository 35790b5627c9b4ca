"""The run configuration: every key with its default and meaning, and its validation.

Experiment files in `experiments/configs/` start from `default_config()` and
change values; they cannot add keys (`lock_config=True`), so a misspelt key
is an error at the command line. `validate` checks values before any compute.
"""

from __future__ import annotations

import hashlib
import json

import ml_collections

from lowcomm_jax import mesh as mesh_lib
from lowcomm_jax.data import corpora
from lowcomm_jax.models import config as model_config
from lowcomm_jax import sharding

ALGORITHMS = ("dp", "diloco", "streaming_diloco", "noloco")

# Keys that may change when a run is resumed: they do not change the trajectory.
RUNTIME_KEYS = ("stop_at_step", "log_every", "eval.every", "eval.num_batches", "checkpoint.every",
                "checkpoint.keep", "hardware.peak_flops_per_device", "hardware.step_seconds",
                "network", "progress_bar", "distributed.timeout_seconds",
                "distributed.init_timeout_seconds")


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # dp: synchronous data parallel (one gradient all-reduce per step); diloco: M replicas (mesh.replica)
  # train alone for H steps, then an outer step; streaming_diloco: fragments, overlap τ, merge α;
  # noloco: outer steps by gossip in random groups of replicas, no all-reduce (the `noloco` section).
  c.algorithm = "dp"
  c.num_replicas = 1  # M: model replicas (workers); mesh.replica devices hold them, M/mesh.replica each
  c.seed = 0  # parameter init and data order.
  c.num_steps = 300  # optimizer steps.
  c.model = ml_collections.ConfigDict(dict(
      size="tiny",  # a preset of lowcomm_jax.models.PRESETS
      dtype="float32",  # activation dtype; parameters stay float32
      d_ff=0,  # SwiGLU hidden width; 0 keeps the preset's (HDEE varies it for S/M/L experts)
      layer_loop="auto",  # auto | scan | unroll: how the forward runs the layers (ModelConfig)
  ))
  c.init_from = ""  # workdir of a finished run whose final parameters start this one (fresh optimizer)
  c.data = ml_collections.ConfigDict(dict(
      corpus="stdlib",  # stdlib | licenses | docstrings | debian:<source> | domain:<HDEE domain>
      seq_len=128,  # tokens per training sequence (bytes)
      batch_size=16,  # global sequences per step (per replica for multi-replica algorithms)
      eval_permille=20,  # held-out documents, per mille (by a hash of the document id)
  ))
  c.optimizer = ml_collections.ConfigDict(dict(
      name="adamw",  # adamw | adam | sgd
      learning_rate=3e-3,  # peak learning rate
      warmup_steps=30,  # linear warm-up, then cosine decay to min_lr_ratio · peak
      min_lr_ratio=0.1,
      weight_decay=0.1,
      b1=0.9,
      b2=0.95,
      momentum=0.0,  # sgd only
      grad_clip=1.0,  # global-norm clip; 0 disables
  ))
  c.diloco = ml_collections.ConfigDict(dict(
      sync_every=50,  # H: inner steps between two syncs of a fragment
      num_fragments=1,  # P: block fragments (1 = the whole model, vanilla DiLoCo)
      fragment_pattern="strided",  # strided (blocks p, p+P, ...) | sequential
      non_block_fragment="own",  # own: embeddings/norm/head form one more fragment | fold: into fragment 0
      staggered=True,  # fragment p syncs at offset (p+1)·H/P; False: all at the same step
      overlap_steps=0,  # τ: inner steps a fragment's all-reduce overlaps before it is applied
      merge_alpha=0.0,  # α: θ ← α·θ_local + (1−α)·θ_global when a fragment is applied
      codec="none",  # none (float32 all-reduce) | e3m0 | e2m1 | int4 | int8 | bf16 | fp32 (compressed mean)
      codec_block_size=1024,  # values per absmax scale in the codec
      codec_rounding="nearest",  # nearest | stochastic
      error_feedback=False,  # add each replica's quantization residual to its next outer gradient
      nonfinite="raise",  # NaN/inf in an averaged outer gradient: raise (stop, naming the fragment)
                          # | skip (refuse that fragment's outer step, restart it from φ, log it)
  ))
  c.noloco = ml_collections.ConfigDict(dict(  # PAPERS.md 2.3; defaults from the paper's code
      sync_every=50,  # H: inner steps between two gossip outer steps
      group_size=2,  # n: replicas per random group (2: pairs); must divide num_replicas
      outer_learning_rate=0.7,  # β: step along the group-mean outer gradient
      outer_momentum=0.5,  # α: heavy-ball momentum of δ
      gamma=0.7,  # γ: pull of φ_i toward its group's mean slow weights
      num_groupings=16,  # random partitions drawn from `seed`; bounds the compiled programs
      codec="none",  # none (float32) | a diloco.codec name: the outer gradients' wire format
      codec_block_size=1024,  # values per absmax scale in the codec
  ))
  c.outer_optimizer = ml_collections.ConfigDict(dict(
      name="nesterov",  # nesterov | sgd | adam, applied to the outer gradient Δ = φ − θ
      learning_rate=0.7,
      momentum=0.9,
  ))
  c.mesh = ml_collections.ConfigDict(dict(replica=1, data=-1, tensor=1, stage=1))  # -1: fill
  c.sharding = ml_collections.ConfigDict(dict(
      layout="replicated",  # replicated | fsdp | tensor | fsdp_tensor
  ))
  c.eval = ml_collections.ConfigDict(dict(every=100, batch_size=16, num_batches=8))
  c.checkpoint = ml_collections.ConfigDict(dict(every=100, keep=2))
  c.log_every = 10
  c.stop_at_step = -1  # stop (with a checkpoint) after this step; -1 runs to num_steps
  c.progress_bar = True  # a tqdm bar on a terminal; plain log lines otherwise
  c.hardware = ml_collections.ConfigDict(dict(
      peak_flops_per_device=0.0,  # for MFU (train/mfu.py); 0 measures the whole host's float32 matmul
      step_seconds=0.0,  # compute seconds per step for the virtual clock; 0: as measured in the run
  ))
  # Virtual clock: "" (off), a preset (datacenter, cross_region, internet, home) or
  # "<bandwidth>,<latency>" such as "1Gbit,50ms"; summary.json then reports the run's wall time on
  # that network from the ledger's bytes and the algorithm's overlap (lowcomm_jax.sim.clock).
  c.network = ""
  # Multi-process runs (experiments/launch_local.py, SLURM, TPU pod slices; lowcomm_jax.distributed).
  # Who the processes are comes from train.py's flags or the environment, not from here.
  c.distributed = ml_collections.ConfigDict(dict(
      timeout_seconds=60,  # a process silent this long (no heartbeat) stops every other one, named
      init_timeout_seconds=300,  # how long processes wait for each other at start-up
  ))
  return c


# The run sizes the experiment configs share: `small` (their default variants) and `tiny`.
RUN_SIZES = {
    "small": {"model.size": "small", "num_steps": 600, "data.seq_len": 128, "data.batch_size": 16,
              "eval.every": 200, "checkpoint.every": 200},
    "tiny": {"model.size": "tiny", "num_steps": 200, "eval.every": 100},
}


def override(c: ml_collections.ConfigDict, changes: dict) -> ml_collections.ConfigDict:
  """Sets dotted keys ("noloco.sync_every": 10) in place and returns `c`; unknown keys raise."""
  for key, value in changes.items():
    section, _, name = key.rpartition(".")
    target = c[section] if section else c
    if name not in target:
      raise ValueError(f"unknown config key {key!r}; see lowcomm_jax/config.py for the allowed keys")
    target[name] = value
  return c


def _flatten(c, prefix="") -> dict:
  out = {}
  for k, v in c.items():
    key = f"{prefix}{k}"
    if isinstance(v, ml_collections.ConfigDict):
      out.update(_flatten(v, key + "."))
    else:
      out[key] = v
  return out


def _require(cond: bool, option: str, allowed: str, value) -> None:
  if not cond:
    raise ValueError(f"{option} must be {allowed}, got {value!r}")


def validate(c: ml_collections.ConfigDict) -> None:
  """One clear ValueError naming the option and the allowed values; no compute happens before."""
  known = set(_flatten(default_config()))
  given = set(_flatten(c))
  unknown = sorted(given - known)
  if unknown:
    raise ValueError(f"unknown config keys {unknown}; see lowcomm_jax/config.py for the allowed keys")
  missing = sorted(known - given)
  if missing:
    raise ValueError(f"config is missing keys {missing}; start from lowcomm_jax.config.default_config()")
  _require(c.algorithm in ALGORITHMS, "algorithm", f"one of {ALGORITHMS}", c.algorithm)
  _require(c.num_steps >= 1, "num_steps", ">= 1", c.num_steps)
  model_config.get_model_config(c.model.size, dtype=c.model.dtype, layer_loop=c.model.layer_loop)
  _require(c.data.corpus in corpora.CORPORA or str(c.data.corpus).startswith(("debian:", "domain:")),
           "data.corpus", f"one of {sorted(corpora.CORPORA)}, 'debian:<source>' or 'domain:<name>'",
           c.data.corpus)
  _require(c.model.d_ff >= 0, "model.d_ff", ">= 0 (0: the preset's)", c.model.d_ff)
  _require(c.data.seq_len >= 2, "data.seq_len", ">= 2", c.data.seq_len)
  _require(c.data.batch_size >= 1, "data.batch_size", ">= 1", c.data.batch_size)
  _require(c.optimizer.name in ("adamw", "adam", "sgd"), "optimizer.name", "adamw, adam or sgd",
           c.optimizer.name)
  _require(c.optimizer.learning_rate >= 0, "optimizer.learning_rate", ">= 0", c.optimizer.learning_rate)
  _require(0 <= c.optimizer.min_lr_ratio <= 1, "optimizer.min_lr_ratio", "in [0, 1]",
           c.optimizer.min_lr_ratio)
  _require(c.optimizer.warmup_steps >= 0, "optimizer.warmup_steps", ">= 0", c.optimizer.warmup_steps)
  sharding.rules_for(c.sharding.layout)
  for key in ("eval.every", "eval.batch_size", "eval.num_batches", "checkpoint.every",
              "checkpoint.keep", "log_every"):
    section, name = key.split(".") if "." in key else (None, key)
    value = c[section][name] if section else c[name]
    _require(value >= 1, key, ">= 1", value)
  if c.network:
    from lowcomm_jax.sim import network  # pylint: disable=g-import-not-at-top
    network.parse_network(c.network)
  _require(c.hardware.step_seconds >= 0, "hardware.step_seconds", ">= 0", c.hardware.step_seconds)
  for key in ("timeout_seconds", "init_timeout_seconds"):
    _require(c.distributed[key] >= 1, f"distributed.{key}", ">= 1 (seconds)", c.distributed[key])
  mesh_lib.mesh_shape(c.mesh.to_dict(), 10**9)  # axis names and sizes; devices are checked later
  if c.algorithm == "dp":
    _require(c.num_replicas == 1 and c.mesh.replica == 1, "num_replicas and mesh.replica",
             "1 for algorithm=dp (use diloco for replicas)", (c.num_replicas, c.mesh.replica))
  elif c.algorithm == "noloco":
    n = c.noloco
    _require(c.num_replicas >= 2, "num_replicas", ">= 2 for algorithm=noloco (gossip needs peers)",
             c.num_replicas)
    _require(n.group_size >= 2 and c.num_replicas % n.group_size == 0, "noloco.group_size",
             f">= 2 and a divisor of num_replicas={c.num_replicas}", n.group_size)
    _require(c.mesh.replica in (1, c.num_replicas), "mesh.replica",
             f"1 (replicas simulated on shared devices) or num_replicas={c.num_replicas} "
             "(one replica per device group) for algorithm=noloco", c.mesh.replica)
    _require(int(n.sync_every) == n.sync_every and n.sync_every >= 1, "noloco.sync_every",
             "an integer >= 1", n.sync_every)
    _require(n.num_groupings >= 1, "noloco.num_groupings", ">= 1", n.num_groupings)
    _require(n.codec == "none" or n.codec in _codec_names(), "noloco.codec",
             f"none or one of {_codec_names()}", n.codec)
    if n.codec != "none":
      from lowcomm_jax import codecs  # pylint: disable=g-import-not-at-top
      codecs.get_codec(n.codec, n.codec_block_size)
  else:
    _require(c.num_replicas >= 1, "num_replicas", ">= 1 (the number of DiLoCo workers M)", c.num_replicas)
    _require(c.mesh.replica >= 1 and c.num_replicas % c.mesh.replica == 0, "mesh.replica",
             f"a divisor of num_replicas={c.num_replicas}", c.mesh.replica)
    if c.algorithm == "diloco":
      d = c.diloco
      _require(d.num_fragments == 1 and d.overlap_steps == 0 and d.merge_alpha == 0.0,
               "diloco.num_fragments/overlap_steps/merge_alpha",
               "1/0/0 for algorithm=diloco (use algorithm=streaming_diloco)",
               (d.num_fragments, d.overlap_steps, d.merge_alpha))
    from lowcomm_jax.optim import schedule, streaming  # pylint: disable=g-import-not-at-top
    num_rows = streaming.count_fragments(c.diloco.num_fragments, c.diloco.non_block_fragment)
    schedule.make_schedule(num_rows, c.diloco.sync_every, c.diloco.overlap_steps,
                           c.diloco.merge_alpha, c.diloco.staggered)
    _require(c.diloco.codec == "none" or c.diloco.codec in _codec_names(), "diloco.codec",
             f"none or one of {_codec_names()}", c.diloco.codec)
    if c.diloco.codec != "none":
      from lowcomm_jax import codecs  # pylint: disable=g-import-not-at-top
      codecs.get_codec(c.diloco.codec, c.diloco.codec_block_size, c.diloco.codec_rounding)
    _require(not c.diloco.error_feedback or c.diloco.codec != "none", "diloco.error_feedback",
             "False unless diloco.codec is set", c.diloco.error_feedback)
    _require(c.diloco.nonfinite in ("raise", "skip"), "diloco.nonfinite", "raise or skip",
             c.diloco.nonfinite)
    _require(c.outer_optimizer.name in ("nesterov", "sgd", "adam"), "outer_optimizer.name",
             "nesterov, sgd or adam", c.outer_optimizer.name)  # axis names and sizes; the device count is checked later


def _codec_names() -> list[str]:
  from lowcomm_jax import codecs  # pylint: disable=g-import-not-at-top
  return list(codecs.CODECS)


def load_run_config(workdir) -> ml_collections.ConfigDict:
  """The config a run directory was started with (from its config.json)."""
  import pathlib  # pylint: disable=g-import-not-at-top
  saved = json.loads((pathlib.Path(workdir) / "config.json").read_text())["config"]
  c = default_config()
  c.update_from_flattened_dict({k: v for k, v in _flatten(ml_collections.ConfigDict(saved)).items()})
  return c


def fingerprint(c: ml_collections.ConfigDict) -> dict:
  """The part of the config that fixes the trajectory (everything but RUNTIME_KEYS)."""
  flat = _flatten(c)
  return {k: v for k, v in sorted(flat.items()) if k not in RUNTIME_KEYS}


def fingerprint_hash(c: ml_collections.ConfigDict) -> str:
  return hashlib.sha256(json.dumps(fingerprint(c), sort_keys=True, default=str).encode()).hexdigest()[:16]
