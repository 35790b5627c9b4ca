"""A/B of the model code: the decoder's gradient step as of a git revision against the working tree.

  nice -n 10 python benchmarks/model_ab.py --rev=5d74de0 [--model=small --rounds=7 --steps=5]

Both variants run in one process: `lowcomm_jax/models/llama.py` read from `--rev` (git show) is
loaded as a module of its own beside the installed one, and each builds the same preset's Decoder
with the same parameters (seed 0), jitted `value_and_grad` of the mean next-token cross-entropy on
one fixed batch. Timed rounds interleave the two (a round runs `--steps` steps of each, in turn), so
that load on a shared machine hits both alike; the figure is process CPU-seconds per step
(`time.process_time`: every XLA thread counts, other processes do not), and the result is the
median over rounds of old ÷ new. The first loss and the largest gradient difference (relative to
each leaf's largest entry) say whether the arithmetic moved. Prints one JSON object; with `--out`
also writes it there.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import importlib.util  # pylint: disable=g-import-not-at-top,wrong-import-position
import json
import pathlib
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from lowcomm_jax import cli, models
from lowcomm_jax.models import llama

_ROOT = pathlib.Path(__file__).parent.parent
_REV = flags.DEFINE_string("rev", "HEAD~1", "Git revision whose llama.py is the old variant.")
_MODEL = flags.DEFINE_string("model", "small", "Model preset.")
_BATCH = flags.DEFINE_integer("batch", 16, "Sequences per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed rounds.")
_STEPS = flags.DEFINE_integer("steps", 5, "Steps of each variant per round.")
_OUT = flags.DEFINE_string("out", "", "Also write the JSON here.")


def old_llama(rev: str):
  """llama.py as of `rev`, loaded as its own module."""
  try:
    source = subprocess.run(["git", "show", f"{rev}:lowcomm_jax/models/llama.py"], cwd=_ROOT,
                            capture_output=True, text=True, check=True).stdout
  except subprocess.CalledProcessError as error:
    raise ValueError(f"--rev: git has no lowcomm_jax/models/llama.py at {rev!r} "
                     f"({error.stderr.strip()})") from None
  path = pathlib.Path(tempfile.mkdtemp()) / "llama_old.py"
  path.write_text(source)
  spec = importlib.util.spec_from_file_location("llama_old", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def grad_step(module, cfg, tokens):
  """(jitted value_and_grad of the loss, the parameters) of `module`'s Decoder."""
  graphdef, params = nnx.split(module.Decoder(cfg, nnx.Rngs(0)), nnx.Param)

  def loss(p):
    logits = nnx.merge(graphdef, p)(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

  return jax.jit(jax.value_and_grad(loss)), params


def main(argv):
  del argv
  if _ROUNDS.value < 1 or _STEPS.value < 1:
    raise ValueError(f"--rounds and --steps: each must be >= 1, got {_ROUNDS.value} and "
                     f"{_STEPS.value}")
  if _MODEL.value not in models.PRESETS:
    raise ValueError(f"--model: {_MODEL.value!r} is not a preset; allowed: "
                     f"{', '.join(sorted(models.PRESETS))}")
  old = old_llama(_REV.value)  # a revision git lacks is refused before anything computes
  cfg = models.get_model_config(_MODEL.value)
  tokens = jax.random.randint(jax.random.key(0), (_BATCH.value, _SEQ_LEN.value + 1), 0,
                              cfg.vocab_size)
  variants = {"old": grad_step(old, cfg, tokens), "new": grad_step(llama, cfg, tokens)}
  first = {name: jax.block_until_ready(step(params)) for name, (step, params) in variants.items()}
  grad_diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))
                  for a, b in zip(jax.tree.leaves(first["old"][1]),
                                  jax.tree.leaves(first["new"][1])))
  per_step = {name: [] for name in variants}
  for _ in range(_ROUNDS.value):
    for name, (step, params) in variants.items():
      start = time.process_time()
      for _ in range(_STEPS.value):
        jax.block_until_ready(step(params))
      per_step[name].append((time.process_time() - start) / _STEPS.value)
  result = {
      "rev": _REV.value, "model": _MODEL.value, "tokens_per_step": _BATCH.value * _SEQ_LEN.value,
      "rounds": _ROUNDS.value, "steps": _STEPS.value,
      "cpu_s_per_step": {n: statistics.median(v) for n, v in per_step.items()},
      "old_over_new": statistics.median(o / n for o, n in zip(per_step["old"], per_step["new"])),
      "first_loss": {n: float(v[0]) for n, v in first.items()},
      "max_grad_diff_relative": grad_diff,
  }
  text = json.dumps(result, indent=1)
  print(text)
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(text + "\n")


if __name__ == "__main__":
  cli.run(main)
