"""The tools that read a run (experiments/generate.py, evaluate.py, export.py) change nothing in it,
running or finished. A training saving every step and keeping one runs while the three read it, one
after the other, up to twice each: it finishes with the parameters of an undisturbed run (one that
saves only at its end), bit for bit; then each reader leaves the finished workdir's listing, sizes,
modes, mtimes and hashes as they were, a save's leftover temporary folder included. No binary
prints orbax's warnings.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from lowcomm_jax.testing import CONFIGS, ROOT, make_config, restored, run_to_end, tree_state
from lowcomm_jax.train import Trainer

CHANGES = {"num_steps": 200, "checkpoint.every": 1, "checkpoint.keep": 1, "data.seq_len": 32,
           "data.batch_size": 8, "eval.every": 1000, "eval.batch_size": 8, "eval.num_batches": 1,
           "log_every": 50, "progress_bar": False}
READS = 2  # of each reader while the training runs
ORBAX_NOISE = ("Type handler registry", "cannot schedule new futures", "Traceback")


# The binaries compile into their own cache folder: the test process's in-process reference run
# then loads no executable that another process wrote while this test ran.
_CACHE = tempfile.mkdtemp(prefix="live-readers-xla-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
_ENV = {**os.environ, "JAX_COMPILATION_CACHE_DIR": _CACHE}


def _readers(workdir, out) -> list[list[str]]:
  binary = lambda name: [sys.executable, str(ROOT / "experiments" / name), f"--workdir={workdir}"]
  return [binary("generate.py") + ["--prompt=def ", "--max_new_tokens=8", "--temperature=0"],
          binary("evaluate.py") + ["--config.eval.num_batches=1"],
          binary("export.py") + [f"--out={out}"]]


def _read(command) -> subprocess.CompletedProcess:
  return subprocess.run(command, capture_output=True, text=True, timeout=240, env=_ENV)


def _one_line(result: subprocess.CompletedProcess, starts: str) -> None:
  """A refusal: exit status 1, nothing on stdout, one line on stderr."""
  assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr[-2000:]
  assert result.stderr.startswith(starts) and result.stderr.count("\n") == 1, result.stderr[-2000:]


def test_readers_leave_a_live_and_a_finished_run_as_they_are(tmp_path):
  workdir = tmp_path / "live"
  command = [sys.executable, str(ROOT / "experiments" / "train.py"),
             f"--config={CONFIGS / 'dp.py'}:tiny", f"--workdir={workdir}",
             *(f"--config.{k}={v}" for k, v in CHANGES.items())]
  train = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=_ENV)
  while train.poll() is None and not list(workdir.glob("checkpoints/*/lowcomm_sha256.json")):
    time.sleep(0.1)
  # A second start, refused before its start-up line, with no orbax line after it.
  _one_line(_read(command),
            f"ValueError: workdir {workdir} is in use by another run (pid {train.pid}")
  live = []  # (reader, its result) of the readers started while the training ran
  while train.poll() is None and len(live) < READS * 3:
    for i, command in enumerate(_readers(workdir, tmp_path / f"export{len(live)}")):
      if train.poll() is None:
        live.append((i, _read(command)))
  out, err = train.communicate(timeout=240)
  assert train.returncode == 0, err[-3000:]
  assert not any(noise in out + err for noise in ORBAX_NOISE), err[-3000:]
  assert {i for i, _ in live} == {0, 1, 2}, f"only {len(live)} reads while the run went on"
  print(f"\n{len(live)} reads while the run went on")
  for _, result in live:
    assert result.returncode == 0, result.stderr[-2000:]
    assert not any(noise in result.stderr for noise in ORBAX_NOISE), result.stderr[-2000:]

  # saving every step or only at the end, the same parameters: the reference saves once
  undisturbed = Trainer(make_config("dp.py", {**CHANGES, "checkpoint.every": 1000}),
                        tmp_path / "undisturbed")
  _, undisturbed_final = run_to_end(undisturbed)
  for a, b in zip(jax.tree.leaves(undisturbed_final.state), jax.tree.leaves(restored(workdir)),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # A finished run, with the temporary folder of a save cut short: each reader changes nothing.
  leftover = workdir / "checkpoints" / "201.orbax-checkpoint-tmp-0"
  leftover.mkdir()
  (leftover / "part").write_bytes(b"\x00" * 64)
  before = tree_state(workdir)
  for command in _readers(workdir, tmp_path / "export_finished"):
    result = _read(command)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not any(noise in result.stderr for noise in ORBAX_NOISE), result.stderr[-2000:]
    assert tree_state(workdir) == before, command[1]

  # A reader's refusal is one line, nothing after it, nothing set aside (the only step's seal
  # edited).
  seal = next(workdir.glob("checkpoints/*/lowcomm_sha256.json"))
  seal.write_text(seal.read_text().replace('"step": ', '"step": 1'))
  before = tree_state(workdir)
  _one_line(_read(_readers(workdir, tmp_path / "refused")[0]),
            f"ValueError: --workdir='{workdir}': no checkpoint restores (1 sealed")
  assert tree_state(workdir) == before
