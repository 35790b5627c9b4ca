"""Every bad input a user can give is refused with one ValueError naming the option and the allowed
values, before anything is written: the workdir (and the folder around it) is byte for byte as
before. One table, from issue 19's reproductions and the checks that were already clean.

The test prints the figure of the closing note: bad inputs tried / refused cleanly / workdirs
changed (`python -m pytest tests/test_bad_inputs.py -q -n 0 -s`).
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import optax
import pytest

import lowcomm_jax
from lowcomm_jax import config as config_lib, distributed
from lowcomm_jax.data import corpora
from lowcomm_jax.optim import schedule
from lowcomm_jax.sim import utilization
from lowcomm_jax.testing import CONFIGS, ROOT, tiny_config, tree_hash
from lowcomm_jax.train import Trainer, validation, workdir as workdir_lib

DILOCO = {"algorithm": "diloco", "num_replicas": 2, "outer.sync_every": 4}
STREAMING = {"algorithm": "streaming_diloco", "num_replicas": 2, "outer.sync_every": 6,
             "outer.num_fragments": 2, "outer.overlap_steps": 1, "outer.merge_alpha": 0.5}
NOLOCO = {"algorithm": "noloco", "num_replicas": 2, "noloco.sync_every": 4, "mesh.data": 1}
SPARSELOCO = {"algorithm": "sparseloco", "num_replicas": 2, "outer.sync_every": 4}
SKIPPIPE = {"gradients": "skippipe", "pipeline.num_stages": 6}

# (config changes, the option the message must name, the allowed values it must state)
CONFIG_CASES = [
    # issue 19, defect 6: values that make no sense
    ({"optimizer.b1": 1.5}, "optimizer.b1", "[0, 1)"),
    ({"optimizer.b2": -0.1}, "optimizer.b2", "[0, 1)"),
    ({"optimizer.weight_decay": -1.0}, "optimizer.weight_decay", ">= 0"),
    ({"optimizer.grad_clip": -1.0}, "optimizer.grad_clip", ">= 0"),
    ({"optimizer.learning_rate": float("inf")}, "optimizer.learning_rate", "a finite number >= 0"),
    ({"optimizer.learning_rate": float("nan")}, "optimizer.learning_rate", "a finite number >= 0"),
    ({"optimizer.momentum": 1.0, "optimizer.name": "sgd"}, "optimizer.momentum", "[0, 1)"),
    ({**DILOCO, "outer_optimizer.learning_rate": -0.7}, "outer_optimizer.learning_rate", "> 0"),
    ({**DILOCO, "outer_optimizer.momentum": 1.5}, "outer_optimizer.momentum", "[0, 1)"),
    ({**NOLOCO, "noloco.gamma": -1.0}, "noloco.gamma", ">= 0"),
    ({**NOLOCO, "noloco.outer_momentum": 1.0}, "noloco.outer_momentum", "[0, 1)"),
    ({**NOLOCO, "noloco.outer_learning_rate": 0.0}, "noloco.outer_learning_rate", "> 0"),
    ({"hardware.peak_flops_per_device": -1.0}, "hardware.peak_flops_per_device", ">= 0"),
    ({"hardware.step_seconds": float("inf")}, "hardware.step_seconds", ">= 0"),
    ({**DILOCO, "outer.sync_every": 50, "num_steps": 20}, "outer.sync_every",
     "[1, num_steps=20]"),
    ({**NOLOCO, "noloco.sync_every": 50, "num_steps": 20}, "noloco.sync_every",
     "[1, num_steps=20]"),
    ({**SPARSELOCO, "outer.codec": "int8"}, "outer.codec/error_feedback",
     "'none'/False for algorithm=sparseloco (its outer gradients travel as sparseloco.top_k"),
    # defect 5: refused only after config.json was written before
    ({"seed": -1}, "seed", "[0, 4294967296)"),
    ({"seed": 2**32}, "seed", "[0, 4294967296)"),
    ({"data.eval_permille": 0}, "data.eval_permille", "[1, 500]"),
    ({"data.eval_permille": 900}, "data.eval_permille", "[1, 500]"),
    ({"data.corpus": "debian:no_such_source"}, "data.corpus", "debian:austen"),
    ({"data.corpus": "debian:austen"}, "data.corpus", "fetch_corpora.py --sources=austen"),
    ({"data.corpus": "domain:no_such_domain"}, "data.corpus", "domain:stdlib"),
    ({"data.corpus": "domain:gcide"}, "data.corpus", "fetch_corpora.py --sources=gcide"),
    ({"data.corpus": "domain_mix:stdlib+no_such_domain"}, "data.corpus", "domain_mix:stdlib"),
    ({"data.corpus": "domain_mix:stdlib+austen"}, "data.corpus",
     "fetch_corpora.py --sources=austen"),
    ({"data.corpus": "wikipedia"}, "data.corpus", "'domain_mix:<domain>+<domain>...'"),
    ({"data.seq_len": 1_000_000}, "data.seq_len=1000000", "data.seq_len at most"),
    ({"eval.batch_size": 100_000}, "eval.batch_size=100000", "eval.batch_size must be <="),
    ({"data.batch_size": 200_000}, "data.batch_size=200000", "data.batch_size must be <="),
    # defect 10: messages that named the wrong thing
    ({**DILOCO, "num_replicas": 3, "mesh.replica": 3}, "mesh.data=-1", "the 8 devices"),
    ({**DILOCO, "outer.codec": "int8", "outer.codec_block_size": 1}, "outer.codec_block_size",
     "an integer >= 2"),
    ({**DILOCO, "outer.codec": "int8", "outer.codec_rounding": "up"}, "outer.codec_rounding",
     "nearest, stochastic"),
    ({**NOLOCO, "noloco.codec": "int8", "noloco.codec_block_size": 0}, "noloco.codec_block_size",
     "an integer >= 2"),
    # refused cleanly before issue 19; they stay so
    ({"algorithm": "sgd"}, "algorithm", "'dp', 'diloco'"),
    ({"num_steps": 0}, "num_steps", ">= 1"),
    ({"model.size": "huge"}, "model.size", "one of"),
    ({"model.d_ff": -1}, "model.d_ff", ">= 0"),
    ({"model.remat": "some"}, "model.remat", "('none', 'full', 'dots')"),
    ({"model.attention": "flash"}, "model.attention", "('xla', 'dot_product', 'cpu_kernel')"),
    ({"model.dtype": "float16"}, "model.dtype", "'float32' or 'bfloat16'"),
    ({"data.seq_len": 1}, "data.seq_len", ">= 2"),
    ({"data.batch_size": 0}, "data.batch_size", ">= 1"),
    ({"data.batch_size": 12}, "data.batch_size=12", "multiple of 8"),
    ({"eval.batch_size": 12}, "eval.batch_size=12", "data axis (8)"),
    ({"optimizer.name": "lion"}, "optimizer.name", "one of adamw, adam, sgd, muon"),
    ({"optimizer.learning_rate": -1.0}, "optimizer.learning_rate", ">= 0"),
    ({"optimizer.min_lr_ratio": 2.0}, "optimizer.min_lr_ratio", "[0, 1]"),
    ({"optimizer.warmup_steps": -1}, "optimizer.warmup_steps", ">= 0"),
    ({"sharding.layout": "zero3"}, "sharding.layout", "one of"),
    ({"eval.every": 0}, "eval.every", ">= 1"),
    ({"eval.num_batches": 0}, "eval.num_batches", ">= 1"),
    ({"checkpoint.every": 0}, "checkpoint.every", ">= 1"),
    ({"checkpoint.keep": 0}, "checkpoint.keep", ">= 1"),
    ({"log_every": 0}, "log_every", ">= 1"),
    ({"network": "dial-up"}, "network", "datacenter"),
    ({"hardware.step_seconds": -1.0}, "hardware.step_seconds", ">= 0"),
    ({"distributed.timeout_seconds": 0}, "distributed.timeout_seconds", ">= 1"),
    ({"distributed.init_timeout_seconds": 0}, "distributed.init_timeout_seconds", ">= 1"),
    ({"mesh.tensor": 0}, "mesh axis sizes", ">= 1 or -1"),
    ({"mesh.tensor": -1}, "at most one mesh axis may be -1", "-1"),
    ({"mesh.data": 16}, "mesh", "at most 8"),
    ({"num_replicas": 2}, "num_replicas and mesh.replica", "1 for algorithm=dp"),
    ({**DILOCO, "num_replicas": 0}, "num_replicas", ">= 1"),
    ({**DILOCO, "mesh.replica": 3}, "mesh.replica", "a divisor of num_replicas=2"),
    ({**DILOCO, "outer.sync_every": 0}, "outer.sync_every", "an integer >= 1"),
    ({**DILOCO, "outer.num_fragments": 2}, "outer.num_fragments", "algorithm=streaming_diloco"),
    ({**DILOCO, "outer.codec": "fp5"}, "outer.codec", "none or one of"),
    ({**DILOCO, "outer.error_feedback": True}, "outer.error_feedback", "unless outer.codec"),
    ({**DILOCO, "nonfinite": "ignore"}, "nonfinite", "raise or skip"),
    ({**DILOCO, "outer_optimizer.name": "lamb"}, "outer_optimizer.name", "nesterov, sgd or adam"),
    ({**STREAMING, "outer.sync_every": 7}, "outer.sync_every",
     "divisible by the number of fragments"),
    ({**STREAMING, "outer.overlap_steps": 3}, "outer.overlap_steps", "smaller than H/P"),
    ({**STREAMING, "outer.merge_alpha": 1.5}, "outer.merge_alpha", "[0, 1]"),
    ({**STREAMING, "outer.fragment_pattern": "random"}, "fragment_pattern", "strided"),
    # eager outer updates: τ = H or 2H only, no error feedback, DiLoCo and Streaming DiLoCo only
    ({**STREAMING, "outer.eager": True}, "outer.eager",
     "outer.overlap_steps (τ) = outer.sync_every (H = 6) or 2H = 12"),
    ({**DILOCO, "outer.eager": True}, "outer.num_fragments/overlap_steps",
     "1/outer.sync_every or twice it/0/'' for algorithm=diloco with outer.eager or naive_delay"),
    ({**DILOCO, "outer.eager": True, "outer.overlap_steps": 4, "outer.codec": "int8",
      "outer.error_feedback": True}, "outer.eager", "False with outer.error_feedback"),
    ({**SPARSELOCO, "outer.eager": True}, "outer.eager/naive_delay",
     "False/False for algorithm=sparseloco"),
    ({**DILOCO, "outer.eager": True, "outer.naive_delay": True, "outer.overlap_steps": 4},
     "outer.naive_delay", "False with outer.eager or outer.error_feedback"),
    ({**DILOCO, "outer.naive_delay": True}, "outer.num_fragments/overlap_steps",
     "1/outer.sync_every or twice it/0/'' for algorithm=diloco with outer.eager or naive_delay"),
    ({**NOLOCO, "num_replicas": 1, "noloco.group_size": 1}, "num_replicas", ">= 2"),
    ({**NOLOCO, "num_replicas": 4, "noloco.group_size": 3}, "noloco.group_size", "divisor of"),
    ({**NOLOCO, "num_replicas": 4, "mesh.replica": 2}, "mesh.replica", "num_replicas=4"),
    ({**NOLOCO, "noloco.sync_every": 0}, "noloco.sync_every", "an integer >= 1"),
    ({**NOLOCO, "noloco.num_groupings": 0}, "noloco.num_groupings", ">= 1"),
    ({**NOLOCO, "noloco.codec": "fp3"}, "noloco.codec", "none or one of"),
    ({"init_from": "/nonexistent/run"}, "init_from", "checkpoints/ of a finished run"),
    # the user's own data and tokenizers (files made by _data_files, relative to the test's folder)
    ({"data.corpus": "text:data/nothing*.txt"}, "data.corpus", "matches no file"),
    ({"data.corpus": "text:data/*.txt"}, "data.corpus", "data/empty.txt is empty"),
    ({"data.corpus": "jsonl:data/docs.jsonl:text"}, "data.corpus",
     "line 2 has no text field 'text'"),
    ({"data.corpus": "jsonl:data/docs.jsonl"}, "data.corpus", "'jsonl:<glob>:<field>'"),
    ({"data.corpus": "tokens:data/short.bin"}, "data.corpus", "has 10 bytes, its metadata says 6"),
    ({"data.corpus": "tokens:data/wide.bin"}, "data.tokenizer='bytes' has 256 tokens",
     "a vocabulary of 5000"),
    ({"data.corpus": "tokens:data/nometa.bin"}, "data.corpus", "no metadata"),
    ({"data.corpus": "hf:data:text"}, "data.corpus",
     "not a folder written by datasets' save_to_disk"),
    ({"data.tokenizer": "data/broken/tokenizer.json"}, "data.tokenizer",
     "is not a Hugging Face tokenizer.json"),
    ({"data.tokenizer": "data/broken.model"}, "data.tokenizer", "is not a SentencePiece model"),
    ({"data.tokenizer": "data/no_such.json"}, "data.tokenizer", "no such file; allowed: 'bytes'"),
    ({"data.doc_chars": -1}, "data.doc_chars", "an integer >= 0"),
    # a section the algorithm does not read is checked all the same
    ({**DILOCO, "outer.codec_rounding": "up"}, "outer.codec_rounding", "nearest, stochastic"),
    ({"outer.codec_rounding": "up"}, "outer.codec_rounding", "nearest, stochastic"),
    ({"mesh.stage": 2}, "mesh.stage", "1 unless gradients=pipeline"),
    ({**DILOCO, "noloco.gamma": -1.0}, "noloco.gamma", ">= 0"),
    ({"noloco.outer_momentum": -0.5}, "noloco.outer_momentum", "[0, 1)"),
    ({"noloco.num_groupings": 0}, "noloco.num_groupings", ">= 1"),
    ({"outer.merge_alpha": 2.0}, "outer.merge_alpha", "[0, 1]"),
    ({"outer.overlap_steps": -1}, "outer.overlap_steps", ">= 0"),
    ({"outer_optimizer.momentum": -0.1}, "outer_optimizer.momentum", "[0, 1)"),
    ({"sparseloco.feedback_decay": 1.5}, "sparseloco.feedback_decay", "[0, 1]"),
    # SparseLoCo's section
    ({**SPARSELOCO, "sparseloco.top_k": 65, "sparseloco.chunk_size": 64}, "sparseloco.top_k",
     "[1, sparseloco.chunk_size = 64]"),
    ({**SPARSELOCO, "sparseloco.chunk_size": 1}, "sparseloco.chunk_size", "an integer >= 2"),
    ({**SPARSELOCO, "sparseloco.bits": 3}, "sparseloco.bits", "1 or 2"),
    ({**SPARSELOCO, "sparseloco.outer_learning_rate": 0.0}, "sparseloco.outer_learning_rate",
     "> 0"),
    ({**SPARSELOCO, "outer.overlap_steps": 4}, "outer.overlap_steps",
     "smaller than H/P = 4"),
    ({**SPARSELOCO, "outer.merge_alpha": -0.5}, "outer.merge_alpha", "[0, 1]"),
    ({**SPARSELOCO, "outer.num_fragments": 3, "outer.sync_every": 6},
     "outer.sync_every", "multiple of"),
    ({**SPARSELOCO, "gradients": "skippipe", "pipeline.num_stages": 6,
      "outer.num_fragments": 2},
     "outer.num_fragments", "1 with gradients=skippipe"),
    # options whose refusal must name them, before compute
    ({**SKIPPIPE, "skippipe.topology": "reference_data"}, "skippipe.topology", "'gcp_12_regions'"),
    ({**SKIPPIPE, "skippipe.placement_seed": -1}, "skippipe.placement_seed", "[0, 4294967296)"),
    ({**SKIPPIPE, "skippipe.path_length": 0}, "skippipe.path_length", "an integer >= 1"),
    ({**SKIPPIPE, "skippipe.path_length": 7}, "skippipe.path_length",
     "gcp_12_regions has 6 stages"),
    ({"pipeline.routing_seed": -1}, "pipeline.routing_seed", "[0, 4294967296)"),
    ({**STREAMING, "outer.num_fragments": 1, "outer.sync_every": 4,
      "outer.fragment_rules": "blocks/.*:0"}, "outer.fragment_rules",
     "must cover every parameter"),
    # gradient accumulation: micro-batches of equal size, each laid out over the data axis
    ({"optimizer.accumulation_steps": 3}, "optimizer.accumulation_steps",
     "a divisor of data.batch_size=8"),
    ({"optimizer.accumulation_steps": 0}, "optimizer.accumulation_steps", "an integer >= 1"),
    ({"optimizer.accumulation_steps": 2}, "optimizer.accumulation_steps=2", "a multiple of 8"),
    ({"gradients": "pipeline", "optimizer.accumulation_steps": 2}, "optimizer.accumulation_steps",
     "1 with gradients=pipeline"),
    ({"gradients": "skippipe", "pipeline.num_stages": 4,
      "skippipe.paths": "0-1-2,0-2-3,0-3-1,0-1-3",
      "mesh.data": 1, "optimizer.accumulation_steps": 4}, "optimizer.accumulation_steps",
     "a multiple of the 4 skippipe.paths"),
]


def _data_files(root):
  """The malformed data the data.corpus and data.tokenizer cases above name."""
  data = root / "data"
  (data / "broken").mkdir(parents=True)
  (data / "empty.txt").write_text("")
  (data / "good.txt").write_text("some text\n")
  (data / "docs.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
  (data / "short.bin").write_bytes(bytes(10))  # 5 uint16 ids, its metadata says 6
  (data / "short.json").write_text('{"dtype": "uint16", "vocab_size": 256, "num_tokens": 6}')
  (data / "wide.bin").write_bytes(bytes(12))
  (data / "wide.json").write_text('{"dtype": "uint16", "vocab_size": 5000, "num_tokens": 6, '
                                  '"tokenizer": "gpt2.json"}')
  (data / "nometa.bin").write_bytes(bytes(12))
  (data / "broken" / "tokenizer.json").write_text('{"model": {"type": "BPE"')
  (data / "broken.model").write_bytes(b"not a protobuf")


def _other_run(workdir, **changes):
  """A workdir holding the config.json a run of `changes` writes (nothing else is needed)."""
  c = tiny_config(**changes)
  workdir_lib.write_config(workdir, json.loads(c.to_json_best_effort()), config_lib.fingerprint(c),
                           corpora.corpus_identity(c.data.corpus))


def _prepare(kind: str, root):
  """Makes the workdir of a workdir case; returns it (a path, or a string as given on a command
  line)."""
  workdir = root / "run"
  if kind == "empty path":
    return ""
  if kind == "a file":
    workdir.write_text("notes\n")
  elif kind == "under a file":
    (root / "notes").write_text("notes\n")
    return root / "notes" / "run"
  elif kind == "unwritable":
    return "/sys/lowcomm_jax_run"  # refuses new files even for root
  elif kind == "broken config.json":
    workdir.mkdir()
    (workdir / "config.json").write_text('{"config": {"algorithm": "dp"')
  elif kind == "config.json without fingerprint":
    workdir.mkdir()
    (workdir / "config.json").write_text('{"config": {}}')
  elif kind == "checkpoints without config.json":
    (workdir / "checkpoints" / "10").mkdir(parents=True)
    (workdir / "checkpoints" / "10" / "_CHECKPOINT_METADATA").write_text("{}")
  elif kind == "metrics without config.json":
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
  elif kind == "the root directory":
    return "/"
  elif kind == "the home directory":
    return str(pathlib.Path.home())
  elif kind == "a dangling symlink":
    workdir.symlink_to(root / "moved_away")
  elif kind == "a folder of other files":
    workdir.mkdir()
    (workdir / "notes.txt").write_text("notes\n")
  elif kind == "init_from checkpoints without config.json":
    (root / "old" / "checkpoints" / "10").mkdir(parents=True)
  elif kind == "another config":
    _other_run(workdir, **{"optimizer.learning_rate": 1e-3})
  elif kind == "another copy of the corpus":
    _other_run(workdir)
    saved = json.loads((workdir / "config.json").read_text())
    saved["corpus_identity"] = "0123456789abcdef"  # as another Python's stdlib would give
    (workdir / "config.json").write_text(json.dumps(saved))
  return workdir


# (workdir case, what the message must say)
WORKDIR_CASES = [
    ("empty path", ["--workdir must name a directory", "got an empty path"]),
    ("a file", ["is a file", "give a directory"]),
    ("under a file", ["cannot be created", "is a file"]),
    ("unwritable", ["cannot be written", "give a writable directory"]),
    ("broken config.json", ["config.json that cannot be read", "use a new --workdir"]),
    ("config.json without fingerprint", ["config.json that cannot be read", "fingerprint"]),
    ("checkpoints without config.json",
     ["holds checkpoints but no config.json", "use a new --workdir"]),
    ("metrics without config.json",
     ["holds metrics.jsonl but no config.json", "use a new --workdir"]),
    ("the root directory", ["--workdir=/ is the root directory", "give a folder of its own"]),
    ("the home directory", ["is the home directory", "give a folder of its own"]),
    ("a dangling symlink", ["is a symbolic link to", "which does not exist"]),
    ("a folder of other files",
     ["holds files that are not a run (notes.txt)", "use a new --workdir"]),
    ("init_from checkpoints without config.json",
     ["init_from=", "holds checkpoints/ but no config.json"]),
    ("another config", ["holds a run of another config (optimizer.learning_rate: 0.001 -> 0.003)"]),
    ("another copy of the corpus", ["another copy of data.corpus='stdlib'", "0123456789abcdef"]),
]


def _attempt(config, workdir) -> str | None:
  """The ValueError's message of a start, None when it was not refused."""
  try:
    Trainer(config, workdir).run()
  except ValueError as error:
    return str(error)
  return None


def test_every_bad_input_is_refused_before_anything_is_written(tmp_path, monkeypatch):
  monkeypatch.setenv("LOWCOMM_CACHE", str(tmp_path / "empty_cache"))  # no Debian corpus fetched
  monkeypatch.chdir(tmp_path)  # an empty --workdir must not write into the current directory
  _data_files(tmp_path)
  rows = []
  for i, (changes, option, allowed) in enumerate(CONFIG_CASES):
    root = tmp_path / f"config{i}"
    root.mkdir()
    before = tree_hash(tmp_path)
    message = _attempt(tiny_config(**changes), root / "run")
    rows.append((f"config {changes}", message, [option, allowed], before != tree_hash(tmp_path)))
  for kind, expected in WORKDIR_CASES:
    root = tmp_path / kind.replace(" ", "_")
    root.mkdir()
    workdir = _prepare(kind, root)
    before = tree_hash(tmp_path)
    changes = {"init_from": str(root / "old")} if kind.startswith("init_from") else {}
    message = _attempt(tiny_config(**changes), workdir)
    rows.append((f"workdir: {kind}", message, expected, before != tree_hash(tmp_path)))

  failures = []
  for name, message, expected, changed in rows:
    clean = message is not None and all(e in message for e in expected) and not changed
    if not clean:
      failures.append(f"{name}: message {message!r}, expected {expected}, files changed: {changed}")
  print(f"\nbad inputs tried: {len(rows)}, refused cleanly: {len(rows) - len(failures)}, "
        f"workdirs changed: {sum(changed for *_, changed in rows)}")
  assert not failures, "\n".join(failures)


def test_the_binary_refuses_in_one_line_without_a_traceback(tmp_path):
  (tmp_path / "file").write_text("notes\n")
  (tmp_path / "broken").mkdir()
  (tmp_path / "broken" / "config.json").write_text("{")
  tiny = f"--config={CONFIGS / 'dp.py'}:tiny"
  for flags, expected in [
      ([tiny, "--workdir="], "--workdir must name a directory"),
      ([tiny, f"--workdir={tmp_path / 'file'}"], "is a file"),
      ([tiny, f"--workdir={tmp_path / 'broken'}"], "config.json that cannot be read"),
      # issue 30, item 10: a 53-line absl traceback before
      ([tiny, f"--workdir={tmp_path / 'run'}", "--config.num_step=10"],
       "--config.num_step: the config has no key 'num_step'; did you mean --config.num_steps"),
      ([f"--config={CONFIGS}", f"--workdir={tmp_path / 'run'}"], "is a folder")]:
    before = tree_hash(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "train.py"), *flags],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert expected in proc.stderr and proc.stderr.startswith("ValueError: ")
    assert "Traceback" not in proc.stderr
    assert tree_hash(tmp_path) == before


# Mistakes on an experiments/ binary's command line (lowcomm_jax.cli): (flags after the binary's
# name, what its one line must say). {configs}: experiments/configs, {root}: the repository.
FLAG_CASES = [
    (["--config={configs}/dp.py:tiny", "--config.num_step=10"],
     "--config.num_step: the config has no key 'num_step'; did you mean --config.num_steps"),
    (["--config={configs}/dp.py:tiny", "--config.optimizer.learnin_rate=0.1"],
     "did you mean --config.optimizer.learning_rate"),
    (["--config={configs}/dp.py:tiny", "--config.noprogress_bar"],
     "did you mean --config.progress_bar"),
    (["--config={configs}/dp.py:tiny", "--config.num_steps=abc"], "--config.num_steps=abc"),
    (["--config={configs}/dp.py:tiny", "--bogus=1"], "Unknown command line flag 'bogus'"),
    (["--config="], "--config must be a config file path[:variant]"),
    (["--config={configs}"], "is a folder; give a config file"),
    (["--config={configs}/no_such_file.py"], "no such file"),
    (["--config={root}/README.md"], "is not a config file that Python runs (SyntaxError"),
    (["--config={root}/lowcomm_jax/checks.py"], "defines no get_config()"),
    (["--config={configs}/dp.py:huge"], "get_config('huge')"),
    # a key that moved: its place now, whatever it was
    (["--config={configs}/diloco.py:tiny", "--config.diloco.sync_every=10"],
     "--config.diloco.sync_every: diloco.sync_every moved to outer.sync_every"),
    (["--config={configs}/diloco.py:tiny", "--config.diloco.codec_kernels=reference"],
     "--config.diloco.codec_kernels: diloco.codec_kernels moved to outer.codec_kernels"),
    (["--config={configs}/sparseloco.py:tiny", "--config.sparseloco.merge_alpha=0.5"],
     "--config.sparseloco.merge_alpha: sparseloco.merge_alpha moved to outer.merge_alpha"),
    (["--config={configs}/diloco.py:tiny", "--noconfig.diloco.staggered"],
     "diloco.staggered moved to outer.staggered"),
    (["--config={tmp}/old_keys.py"],
     "sets a key that moved: the diloco section moved to outer (diloco.<key> is now outer.<key>)"),
]


def _parse_as_train_py(argv):
  """cli.parse_flags of `argv` with flags defined as experiments/train.py does, apart from absl's
  FLAGS."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  from lowcomm_jax import cli  # pylint: disable=g-import-not-at-top
  argv = ["train.py", *argv]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True,
                                  flag_values=flag_values, sys_argv=argv)
  flags.DEFINE_string("workdir", "run", "Run directory.", flag_values=flag_values)
  cli.parse_flags(argv, flag_values)
  return flag_values


@pytest.mark.parametrize("argv,expected", FLAG_CASES)
def test_command_line_mistakes_are_one_line_naming_the_flag(argv, expected, tmp_path):
  (tmp_path / "old_keys.py").write_text(  # a config file written for the diloco section
      "from lowcomm_jax import config\n\n\ndef get_config():\n  c = config.default_config()\n"
      "  c.diloco.sync_every = 10\n  return c\n")
  with pytest.raises(SystemExit) as stop:
    _parse_as_train_py([a.format(configs=CONFIGS, root=ROOT, tmp=tmp_path) for a in argv])
  message = stop.value.code
  assert isinstance(message, str) and message.startswith("ValueError: ") and "\n" not in message
  assert expected in message, message


def test_a_correct_command_line_parses_as_before():
  parsed = _parse_as_train_py([f"--config={CONFIGS}/dp.py:tiny", "--config.num_steps=7",
                               "--noconfig.progress_bar", "--workdir=w"])
  assert (parsed.config.num_steps, parsed.config.progress_bar, parsed.workdir) == (7, False, "w")


def test_hdee_refuses_with_the_fetch_command_when_corpora_are_missing(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "hdee.py"), f"--workdir={tmp_path / 'hdee'}",
       "--quick"], capture_output=True, text=True, timeout=300,
      env={**os.environ, "LOWCOMM_CACHE": str(tmp_path / "empty_cache"), "PATH": ""})  # no apt-get
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "HDEE reads 13 Debian corpora that are not in" in proc.stderr
  assert "python experiments/fetch_corpora.py --sources=python_docs,octave_manual" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "hdee").exists() and not (tmp_path / "empty_cache").exists()


# Every place a user gives H: (the option its message names: the argument for the Python API, the
# config key for a config; a call with H = h; whether it takes any Python value: the config's ints
# are type-checked by ml_collections before validation).
SYNC_EVERY_ENTRIES = [
    ("sync_every", lambda h: lowcomm_jax.diloco(optax.sgd(0.1), sync_every=h), True),
    ("sync_every", lambda h: lowcomm_jax.streaming_diloco(  # fragments known only at init
        optax.sgd(0.1), sync_every=h, fragments=lambda params: ()), True),
    ("outer.sync_every", lambda h: schedule.make_schedule(1, h), True),
    ("sync_every",
     lambda h: lowcomm_jax.noloco(optax.sgd(0.1), num_replicas=2, sync_every=h), True),
    ("sync_every", lambda h: lowcomm_jax.sparseloco(optax.sgd(0.1), sync_every=h), True),
    ("Method.sync_every", utilization.diloco, True),
    ("outer.sync_every",
     lambda h: validation.validate(tiny_config(**{**DILOCO, "outer.sync_every": h})), False),
    ("noloco.sync_every",
     lambda h: validation.validate(tiny_config(**{**NOLOCO, "noloco.sync_every": h})), False),
    ("outer.sync_every", lambda h: validation.validate(
        tiny_config(**{**SPARSELOCO, "outer.sync_every": h})), False),
]


@pytest.mark.parametrize("option,give,any_value", SYNC_EVERY_ENTRIES)
def test_sync_every_is_checked_by_one_function_everywhere(option, give, any_value):
  """The same words for H wherever it is given; a bool, a string or NaN are no integer (they used to
  pass as 1, or fail with a TypeError that named nothing)."""
  for h in [0, -3] + ([True, "4", 2.5, float("nan")] if any_value else []):
    with pytest.raises(ValueError) as error:
      give(h)
    assert str(error.value) == f"{option} (H) must be an integer >= 1, got {h!r}"
  give(4)  # allowed: no error


def test_sync_every_knows_the_run_length_and_the_fragments():
  with pytest.raises(ValueError, match=re.escape(
      "noloco.sync_every (H) must be an integer in [1, num_steps=20] (H > num_steps: no outer step "
      "would ever happen), got 21")):
    validation.validate(tiny_config(**{**NOLOCO, "noloco.sync_every": 21, "num_steps": 20}))
  validation.validate(tiny_config(**{**NOLOCO, "noloco.sync_every": 20, "num_steps": 20}))
  staggered = (
    "outer.sync_every (H=7) must be divisible by the number of fragments (P=3, counting "
    "the non-block fragment) for a staggered schedule: a multiple of 3 such as 6 or 9"
  )
  with pytest.raises(ValueError, match=re.escape(staggered)):
    validation.validate(tiny_config(**{**STREAMING, "outer.sync_every": 7}))
  with pytest.raises(ValueError, match="^" + re.escape(staggered.removeprefix("outer."))):
    lowcomm_jax.streaming_diloco(optax.sgd(0.1), sync_every=7, fragments=2)  # names the argument
  lowcomm_jax.streaming_diloco(optax.sgd(0.1), sync_every=7, fragments=2, staggered=False)


@pytest.mark.parametrize("bind,message", [
    ("127.0.0.1", "--coordinator_bind_address must be host:port"),
    ("::1", "--coordinator_bind_address must be host:port .*an IPv6 address goes in brackets"),
    ("::1:1234", "--coordinator_bind_address .*an IPv6 address goes in brackets"),
    ("[::1]", "--coordinator_bind_address must be host:port"),
    ("[not-ipv6]:1234",
     "--coordinator_bind_address .*'not-ipv6' in brackets is not an IPv6 address"),
    ("127.0.0.1:0", r"--coordinator_bind_address must be host:port with a port in 1\.\.65535"),
    ("127.0.0.1:65536", r"--coordinator_bind_address must be host:port with a port in 1\.\.65535"),
    ("127.0.0.1:http", r"--coordinator_bind_address must be host:port with a port in 1\.\.65535"),
    ("bad host:1234", "--coordinator_bind_address .*'bad host' is not a host name or address"),
])
def test_bad_bind_address_is_named(bind, message):
  with pytest.raises(ValueError, match=message):
    distributed.initialize("on", "127.0.0.1:1234", 2, 0, coordinator_bind_address=bind)
  with pytest.raises(ValueError, match="--distributed=off cannot be combined"):
    distributed.initialize("off", coordinator_bind_address="127.0.0.1:1234")


def test_a_runtime_policy_may_change_on_resume(tmp_path):
  """nonfinite (what a NaN in the global model does) is no part of the trajectory's fingerprint:
  the advice of a `raise` ("set nonfinite=skip") is taken on the same workdir."""
  _other_run(tmp_path / "run", **{**DILOCO, "nonfinite": "raise"})
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  saved["fingerprint"]["diloco.nonfinite"] = "raise"  # as a run started before it became run-time
  (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
  before = tree_hash(tmp_path)
  assert Trainer(tiny_config(**{**DILOCO, "nonfinite": "skip"}), tmp_path / "run").resuming
  assert tree_hash(tmp_path) == before
  assert _attempt(tiny_config(**{**DILOCO, "outer.sync_every": 8}), tmp_path / "run") is not None


def test_a_key_that_moved_is_refused_naming_its_place_now(tmp_path):
  """From Python (`config.override`), and in a ConfigDict that holds it (a config file that added
  it, a dict of old keys): one line per key, before anything is written."""
  for key, now in [("diloco.sync_every", "outer.sync_every"), ("diloco.codec", "outer.codec"),
                   ("sparseloco.num_fragments", "outer.num_fragments")]:
    with pytest.raises(ValueError, match=f"^{re.escape(key)} moved to {re.escape(now)}$"):
      config_lib.override(tiny_config(), {key: 2})
  c = tiny_config(**SPARSELOCO)
  c.sparseloco.sync_every = 4  # a config file's get_config() may add keys before the lock
  c.diloco = {"fragment_rules": ""}
  with pytest.raises(ValueError, match=r"^diloco\.fragment_rules moved to outer\.fragment_rules; "
                     r"sparseloco\.sync_every moved to outer\.sync_every$"):
    Trainer(c, tmp_path / "run")
  assert list(tmp_path.iterdir()) == []


def _saved_with_old_keys(workdir, changes: dict, old: dict):
  """A run's config.json as it was written before the `outer` section: `changes`' run with its
  outer.* keys saved under their old names (`old`: outer key -> old key, the rest diloco.*), plus
  the diloco.* keys a SparseLoCo run did not read, at values that are not their defaults. The
  outer.* keys added since (outer.eager, outer.naive_delay) are not in it: such a run never saw
  them."""
  _other_run(workdir, **changes)
  saved = json.loads((workdir / "config.json").read_text())
  flat = {}
  for key, value in saved["fingerprint"].items():
    name = key.removeprefix("outer.")
    if key.startswith("outer.") and f"diloco.{name}" not in config_lib.MOVED_KEYS:
      continue
    flat[old.get(key, f"diloco.{name}") if key.startswith("outer.") else key] = value
  if changes.get("algorithm") == "sparseloco":
    flat |= {"diloco.sync_every": 50, "diloco.codec": "int8", "diloco.error_feedback": True}
  saved["fingerprint"] = flat
  (workdir / "config.json").write_text(json.dumps(saved))
  return flat


def test_a_run_saved_with_the_old_keys_resumes_at_their_places_now(tmp_path):
  """A config.json of diloco.* keys (and SparseLoCo's sparseloco.* schedule) is read at the keys'
  places now: the same run resumes (nothing is written), another value of a moved key is refused
  naming it, and the run's readers see its values in today's keys."""
  streaming = {**STREAMING, "outer.overlap_steps": 1, "outer.codec": "int8"}
  flat = _saved_with_old_keys(tmp_path / "streaming", streaming, {})
  assert flat["diloco.overlap_steps"] == 1 and "outer.overlap_steps" not in flat
  sparse = {**SPARSELOCO, "outer.overlap_steps": 1, "outer.merge_alpha": 0.5}
  old = {f"outer.{k}": f"sparseloco.{k}" for k in ("sync_every", "num_fragments",
                                                    "overlap_steps", "merge_alpha")}
  _saved_with_old_keys(tmp_path / "sparse", sparse, old)
  upgraded = config_lib.upgrade_saved(flat)
  # every key at its place now; a key added since is missing (a resume takes it at its default)
  assert upgraded == {k: v for k, v in config_lib.fingerprint(tiny_config(**streaming)).items()
                      if k not in ("outer.eager", "outer.naive_delay")}
  before = tree_hash(tmp_path)
  assert Trainer(tiny_config(**streaming), tmp_path / "streaming").resuming
  assert Trainer(tiny_config(**sparse), tmp_path / "sparse").resuming
  assert _attempt(tiny_config(**{**sparse, "outer.merge_alpha": 0.25}), tmp_path / "sparse") == (
      f"workdir {tmp_path / 'sparse'} holds a run of another config (outer.merge_alpha: 0.5 -> "
      f"0.25); use a new --workdir or the same config to resume")
  # The fingerprint is every key but the run-time ones, read by the run's algorithm or not: a
  # section SparseLoCo's row does not declare still fixes the run.
  assert "outer_optimizer.momentum" in _attempt(
      tiny_config(**{**sparse, "outer_optimizer.momentum": 0.5}), tmp_path / "sparse")
  assert tree_hash(tmp_path) == before
  saved = json.loads((tmp_path / "streaming" / "config.json").read_text())
  saved["config"]["diloco"] = saved["config"].pop("outer")
  for key in ("eager", "naive_delay"):
    del saved["config"]["diloco"][key]
  (tmp_path / "streaming" / "config.json").write_text(json.dumps(saved))
  assert config_lib.flatten(config_lib.load_run_config(tmp_path / "streaming")) == (
      config_lib.flatten(tiny_config(**streaming)))


def test_summary_is_strict_json_with_the_reason_of_each_null(tmp_path):
  summary = {"final_eval_loss": float("nan"), "tokens_per_s": float("nan"), "mfu": float("inf"),
             "final_eval_loss_replicas": [1.5, float("-inf")], "steps": 40}
  written = workdir_lib.write_summary(tmp_path, summary, {"tokens_per_s": "no timed step"})

  def refuse(constant):
    raise AssertionError(f"summary.json holds {constant}, which is not JSON")

  assert json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse) == written
  assert written["final_eval_loss"] is None and written["final_eval_loss_replicas"] == [1.5, None]
  assert written["null_reasons"] == {
      "final_eval_loss": "was nan (not a finite number)", "tokens_per_s": "no timed step",
      "mfu": "was inf (not a finite number)",
      "final_eval_loss_replicas[1]": "was -inf (not a finite number)"}
  workdir_lib.write_summary(tmp_path, {"tokens_per_s": None}, {"tokens_per_s": "no timed step"})
  assert json.loads((tmp_path / "summary.json").read_text())["null_reasons"] == {
      "tokens_per_s": "no timed step"}
