"""The run configuration's validation: every value checked before any compute and before anything
is written, one ValueError naming the option and its allowed values (each key's comment in
`lowcomm_jax.config` gives its range); what passes comes back parsed, a frozen
`lowcomm_jax.run_config.RunConfig` that the Trainer and the elastic driver take.

The sections an algorithm reads are checked by that algorithm's `check_config`
(`train.algorithms.ALGORITHMS`), the sections a gradient source reads by that source's
(`train.sources.SOURCES`); every section's values are range-checked whichever algorithm and source
run (a `noloco.gamma` of -1 is refused in a DiLoCo run too).
"""

from __future__ import annotations

import math

import ml_collections

from lowcomm_jax import checks, config as config_lib, mesh as mesh_lib, run_config, sharding
from lowcomm_jax.data import corpora, files, pipeline, tokenizer as tokenizer_lib
from lowcomm_jax.models import config as model_config, hf_llama
from lowcomm_jax.optim import alignment, inner
from lowcomm_jax.optim.staleness import STALENESS_RULES
from lowcomm_jax.sim import network
from lowcomm_jax.train import algorithms, faults, sources


def validate(c: ml_collections.ConfigDict) -> run_config.RunConfig:
  """`c` checked and parsed: its frozen `RunConfig`, or one clear ValueError naming the option and
  the allowed values; no compute happens before."""
  _check(c)
  return run_config.parse(c)


def checked(config) -> run_config.RunConfig:
  """A RunConfig as it is (it was checked when it was made), a ConfigDict `validate`d."""
  return config if isinstance(config, run_config.RunConfig) else validate(config)


def _check(c: ml_collections.ConfigDict) -> None:
  known = set(config_lib.flatten(config_lib.default_config()))
  given = set(config_lib.flatten(c))
  moved = [config_lib.moved_key_error(k) for k in sorted(given - known)]
  if any(moved):
    raise ValueError("; ".join(m for m in moved if m))
  unknown = sorted(given - known)
  if unknown:
    raise ValueError(f"unknown config keys {unknown}; see lowcomm_jax/config.py for the allowed "
                     f"keys")
  missing = sorted(known - given)
  if missing:
    raise ValueError(f"config is missing keys {missing}; start from "
                     f"lowcomm_jax.config.default_config()")
  names = tuple(algorithms.ALGORITHMS)
  checks.require(c.algorithm in names, "algorithm", f"one of {names}", c.algorithm)
  checks.integer(c, "num_steps", 1)
  checks.integer(c, "seed", 0, 2**32, " (it seeds the parameters and grain's shuffle)")
  if not c.model.size.startswith(hf_llama.PREFIX):  # hf:<folder>: read when the model is built
    model_config.get_model_config(c.model.size, **config_lib.model_options(c))
  corpora.check_available(c.data.corpus)  # its form, and fetched: before anything is written
  _check_tokenizer(c)
  checks.require(c.model.d_ff >= 0, "model.d_ff", ">= 0 (0: the preset's)", c.model.d_ff)
  checks.require(c.data.seq_len >= 2, "data.seq_len", ">= 2", c.data.seq_len)
  checks.require(c.data.batch_size >= 1, "data.batch_size", ">= 1", c.data.batch_size)
  checks.require(1 <= c.data.eval_permille <= 500, "data.eval_permille",
                 "in [1, 500] (per mille of documents held out)", c.data.eval_permille)
  checks.require(c.optimizer.name in inner.OPTIMIZERS, "optimizer.name",
                 f"one of {', '.join(inner.OPTIMIZERS)}", c.optimizer.name)
  checks.number(c, "optimizer.learning_rate", 0)
  checks.number(c, "optimizer.min_lr_ratio", 0, 1, high_open=False)
  checks.require(c.optimizer.warmup_steps >= 0, "optimizer.warmup_steps", ">= 0",
                 c.optimizer.warmup_steps)
  checks.number(c, "optimizer.weight_decay", 0)
  for key in ("optimizer.b1", "optimizer.b2", "optimizer.momentum"):
    checks.number(c, key, 0, 1)
  checks.number(c, "optimizer.grad_clip", 0)
  checks.integer(c, "optimizer.accumulation_steps", 1)
  checks.require(c.data.batch_size % c.optimizer.accumulation_steps == 0,
                 "optimizer.accumulation_steps",
                 f"a divisor of data.batch_size={c.data.batch_size} (micro-batches of equal size)",
                 c.optimizer.accumulation_steps)
  sharding.rules_for(c.sharding.layout)
  for key in ("eval.every", "eval.batch_size", "eval.num_batches", "checkpoint.every",
              "checkpoint.keep", "log_every"):
    section, name = key.split(".") if "." in key else (None, key)
    value = c[section][name] if section else c[name]
    checks.require(value >= 1, key, ">= 1", value)
  if c.network:
    network.parse_network(c.network)
  checks.number(c, "hardware.step_seconds", 0)
  checks.number(c, "hardware.peak_flops_per_device", 0)
  for key in ("timeout_seconds", "init_timeout_seconds"):
    checks.require(c.distributed[key] >= 1, f"distributed.{key}", ">= 1 (seconds)",
                   c.distributed[key])
  # Axis names and sizes only: the device count (checked by the Trainer) is not known here, so ask
  # for exactly as many devices as the fixed axes use.
  fixed = math.prod(max(int(n), 1) for n in c.mesh.to_dict().values() if isinstance(n, int))
  mesh_lib.mesh_shape(c.mesh.to_dict(), fixed)
  checks.require(c.nonfinite in ("raise", "skip"), "nonfinite", "raise or skip", c.nonfinite)
  checks.require(c.gradients in sources.SOURCES, "gradients", f"one of {sources.GRADIENTS}",
                 c.gradients)
  sources.check_every_section(c)
  sources.SOURCES[c.gradients].check_config(c)
  algorithms.ALGORITHMS[c.algorithm].check_config(c)
  algorithms.check_every_section(c)
  _check_elastic_values(c)


def _check_elastic_values(c) -> None:
  """The `elastic` section (read by experiments/elastic.py), whatever the run."""
  e = c.elastic
  checks.integer(c, "elastic.num_learners", 1)
  checks.integer(c, "elastic.min_quorum", 0, e.num_learners + 1,
                 f" (0: every learner; at most elastic.num_learners={e.num_learners})")
  checks.number(c, "elastic.grace_s", 0)
  checks.require(isinstance(e.adaptive_grace, bool), "elastic.adaptive_grace", "True or False",
                 e.adaptive_grace)
  checks.require(e.late in ("drop", "weight"), "elastic.late", "one of drop, weight", e.late)
  checks.number(c, "elastic.staleness_weight", 0, 1, low_open=True, high_open=False)
  faults.parse(e.faults, e.num_learners)
  checks.number(c, "elastic.faults_per_hour", 0)
  checks.require(isinstance(e.address, str), "elastic.address",
                 "a string ('' for a local Ray, 'auto' or host:port)", e.address)
  checks.integer(c, "elastic.max_restarts", 0)
  checks.number(c, "elastic.learner_cpus", 0, low_open=True)
  checks.number(c, "elastic.learner_gpus", 0)
  checks.number(c, "elastic.timeout_s", 0, low_open=True)
  faults.speeds(e.speeds, e.num_learners)
  for key in ("asynchronous", "buffer_barrier", "log_deltas"):
    checks.require(isinstance(e[key], bool), f"elastic.{key}", "True or False", e[key])
  checks.require(e.staleness in STALENESS_RULES, "elastic.staleness",
                 f"one of {', '.join(STALENESS_RULES)}", e.staleness)
  checks.integer(c, "elastic.max_staleness", 0)
  alignment.check_hyperparameters(c, "elastic.heloco_")
  checks.require(e.local_steps in ("equal", "by_speed"), "elastic.local_steps",
                 "one of equal, by_speed", e.local_steps)


def _check_tokenizer(c) -> None:
  """data.tokenizer loads, gives back the text it encodes (bits per byte count decoded bytes), fits
  the corpus (domains are bytes; pre-tokenized ids were made by it);
  data.doc_chars and data.doc_separator have their types."""
  checks.require(isinstance(c.data.doc_chars, int) and c.data.doc_chars >= 0, "data.doc_chars",
                 "an integer >= 0 (0: documents are not cut by length)", c.data.doc_chars)
  checks.require(isinstance(c.data.doc_separator, str), "data.doc_separator", "a string",
                 c.data.doc_separator)
  tok = tokenizer_lib.load_tokenizer(c.data.tokenizer)
  tokenizer_lib.check_exact_bytes(tok)
  if str(c.data.corpus).startswith(("domain:", "domain_mix:")):
    checks.require(c.data.tokenizer == "bytes", "data.tokenizer",
                   f"'bytes' with data.corpus={c.data.corpus!r} (domains are byte streams)",
                   c.data.tokenizer)
  if str(c.data.corpus).startswith("tokens:"):
    pipeline.check_token_vocab(c.data.corpus, files.token_metadata(c.data.corpus)[1], tok)
