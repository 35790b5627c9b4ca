"""The run directory: what a start may find there, checked before anything is written.

A workdir is one of three things, and a start behaves accordingly:

- new (absent or empty): the run starts at step 0 and writes config.json first (`/` and the home
  directory are never a workdir, nor a symbolic link to nothing);
- a run of the same kind and config (its config.json's kind, fingerprint, corpus identity and inputs
  match): it resumes from the latest checkpoint, or, when summary.json is there, says the run is
  complete and changes nothing;
- anything else (a file, an unwritable place, another config, a run of the other binary, a
  different corpus, tokenizer or tokens file, run files without config.json, other files without
  config.json, an unreadable config.json): one ValueError naming what is wrong and what to do, and
  the directory is left byte for byte as it was (the writability probe included: it writes only
  into a folder the run will write into).

One run at a time: `RunLock` holds an exclusive `fcntl.flock` on LOCK_FILE for the whole run (the
kernel releases it when the process ends, however it ends); a second start is refused naming the
holder's pid and host, before it prints anything (`check_not_locked`).

config.json and summary.json are replaced whole (a temporary file renamed), so a crash leaves the
old file or the new one, never a torn one; a summary.json that cannot be read is no finished run.
summary.json is strict JSON: a value that is NaN or inf becomes null, and `null_reasons` says why.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import pathlib
import socket
import tempfile
import time

from lowcomm_jax import config as config_lib
from lowcomm_jax.train import run_inputs

# Files and folders a run writes; any of them without config.json is a damaged or foreign run.
RUN_FILES = ("checkpoints", "checkpoints_unreadable", "metrics.jsonl", "summary.json",
             "tensorboard", "syncer", "learners", run_inputs.TOKENIZER_DIR)
NEW, RESUME, COMPLETE = "new", "resume", "complete"
# The kinds of run (config.json's "kind"), the binary that trains each and the folder it writes.
KINDS = {"train": ("experiments/train.py", "checkpoints"),
         "elastic": ("experiments/elastic.py", "syncer")}
# Held locked by the running start (its pid and host inside). Alone in a folder, or with the
# temporary file of a config.json write cut short, it leaves the folder new.
LOCK_FILE = "run.lock"


def check_path(workdir) -> pathlib.Path:
  """The workdir as a path; raises unless it is (or can become) a writable directory."""
  if workdir is None or not str(workdir).strip():
    raise ValueError("--workdir must name a directory (a new one, or a run to resume), got an "
                     "empty path; a run is never written into the current directory by default")
  path = pathlib.Path(workdir)
  if path.is_symlink() and not path.exists():
    raise ValueError(f"--workdir={workdir} is a symbolic link to {os.readlink(path)}, which does "
                     f"not exist; give a directory (new, or a run to resume), or create the link's "
                     "target")
  resolved = path.expanduser().resolve()
  if resolved in (pathlib.Path("/"), pathlib.Path.home().resolve()):
    what = "the root directory" if resolved.parent == resolved else "the home directory"
    raise ValueError(f"--workdir={workdir} is {what}; a run writes its files into its workdir: "
                     f"give a folder of its own, e.g. {resolved / 'runs' / 'my_run'}")
  if path.exists() and not path.is_dir():
    raise ValueError(f"--workdir={workdir} is a file; give a directory (new, or a run to resume)")
  existing = path
  while not existing.exists():
    existing = existing.parent
  if not existing.is_dir():
    raise ValueError(f"--workdir={workdir} cannot be created: {existing} is a file")
  if path.is_dir():  # what is there first: a refused folder is never written into, even a probe
    read_run(path)
    if read_summary(path) is not None:
      return path  # a finished run: nothing will be written
  try:  # os.access says yes to root everywhere; a real (removed at once) file says the truth
    with tempfile.TemporaryFile(dir=existing):
      pass
  except OSError as error:
    raise ValueError(f"--workdir={workdir} cannot be written: {existing} refuses new files "
                     f"({type(error).__name__}: {error.strerror}); give a writable "
                     f"directory") from None
  return path


def read_run(workdir: pathlib.Path) -> dict | None:
  """config.json of a run directory; None for a new one. Raises for run files without it, or a
  config.json that is not what a run writes."""
  saved = workdir / "config.json"
  if not saved.exists():
    found = sorted(name for name in RUN_FILES if (workdir / name).exists())
    if found:
      raise ValueError(f"workdir {workdir} holds {', '.join(found)} but no config.json, so which "
                       f"run they belong to is unknown; refusing to resume or overwrite them: use "
                       f"a new --workdir (or restore that run's config.json)")
    ours = lambda name: (
      name == LOCK_FILE or (name.startswith(".config.json.") and name.endswith(".tmp"))
    )
    others = (
      sorted(p.name for p in workdir.iterdir() if not ours(p.name)) if workdir.is_dir() else []
    )
    if others:
      shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
      raise ValueError(f"workdir {workdir} holds files that are not a run ({shown}) and no "
                       "config.json; a new run needs an absent or empty folder: use a new "
                       "--workdir")
    return None
  try:
    run = json.loads(saved.read_text())
    if not isinstance(run, dict) or not isinstance(run.get("fingerprint"), dict):
      raise ValueError("no 'fingerprint' object")
  except (ValueError, UnicodeDecodeError) as error:
    raise ValueError(f"workdir {workdir} has a config.json that cannot be read ({error}); it is "
                     f"not the file a run writes: use a new --workdir, or restore that "
                     f"file") from None
  return run


def kind_of(workdir: pathlib.Path, run: dict) -> str | None:
  """The kind of run (a key of KINDS) config.json saved, or for a run saved before kinds were, the
  one whose folder is there; None when neither says."""
  if run.get("kind") in KINDS:
    return run["kind"]
  found = [kind for kind, (_, folder) in KINDS.items() if (pathlib.Path(workdir) / folder).exists()]
  return found[0] if len(found) == 1 else None


def check_workdir(workdir: pathlib.Path, fingerprint: dict, defaults: dict | None = None,
                  corpus_identity: str | None = None, inputs: dict | None = None,
                  kind: str = "train") -> str:
  """NEW, RESUME or COMPLETE for a start of the run `fingerprint` in `workdir`; raises otherwise.

  A run of another `kind` (KINDS: train.py's or elastic.py's) is refused naming it. `inputs` (the
  run's tokenizer and tokens file now, `run_inputs.describe`) must match those the run saved.

  A key the saved run does not know (added to the config since) counts as its default value; a key
  it saved that is fingerprinted no more (e.g. diloco.nonfinite, now the run-time key nonfinite) is
  not compared; one that moved (`config.MOVED_KEYS`) is compared at its new place. A saved corpus
  identity (`lowcomm_jax.data.corpora.corpus_identity`) must equal `corpus_identity`, so a resume
  never trains on other text (another Python's stdlib, another Debian release) unnoticed. Reads
  only: an existing run directory is never changed by a refused start.
  """
  run = read_run(pathlib.Path(workdir))
  if run is None:
    return NEW
  found = kind_of(workdir, run)
  if found is not None and found != kind:
    raise ValueError(f"workdir {workdir} holds a run of {KINDS[found][0]} (a {found} run: its "
                     f"{KINDS[found][1]}/ is there), which {KINDS[kind][0]} cannot resume or "
                     f"overwrite; use a new --workdir, or {KINDS[found][0]} to resume it")
  current = json.loads(json.dumps(fingerprint, default=str))
  defaults = json.loads(json.dumps(defaults or {}, default=str))
  # A saved key fingerprinted no more (now a run-time key, or gone from the config) is not compared;
  # one that moved (diloco.sync_every, now outer.sync_every) is compared at its new place.
  saved = config_lib.upgrade_saved(run["fingerprint"])
  previous = {k: v for k, v in saved.items() if k in current or k in defaults}
  for key, value in defaults.items():
    previous.setdefault(key, value)
  differing = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
  if differing:
    details = ", ".join(f"{k}: {previous.get(k)!r} -> {current.get(k)!r}" for k in differing[:8])
    raise ValueError(f"workdir {workdir} holds a run of another config ({details}); "
                     "use a new --workdir or the same config to resume")
  changed = run_inputs.difference(workdir, run.get("inputs"), inputs) if inputs else None
  if changed:
    raise ValueError(changed)
  saved_identity = run.get("corpus_identity")
  if saved_identity and corpus_identity and saved_identity != corpus_identity:
    raise ValueError(
        f"workdir {workdir} was trained on another copy of "
        f"data.corpus={run['config']['data']['corpus']!r} (corpus identity {saved_identity}, "
        f"here {corpus_identity}: its files or their sizes differ, e.g. another Python version or "
        f"Debian release); resuming would train on other text: resume where the run started, or "
        f"use a new --workdir")
  return COMPLETE if read_summary(pathlib.Path(workdir)) is not None else RESUME


def read_summary(workdir: pathlib.Path) -> dict | None:
  """summary.json of a finished run; None when it is absent or cannot be read (then the run is not
  complete: a resume writes it again)."""
  try:
    summary = json.loads((workdir / "summary.json").read_text())
  except (OSError, ValueError):
    return None
  return summary if isinstance(summary, dict) else None


def write_atomic(path: pathlib.Path, text: str) -> None:
  """Replaces `path` by a file holding `text`: a temporary file beside it, flushed, then renamed."""
  with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                   delete=False) as tmp:
    tmp.write(text)
    tmp.flush()
    os.fsync(tmp.fileno())
  os.replace(tmp.name, path)


class WorkdirInUse(ValueError):
  """Another start holds the workdir's lock (or this process cannot see process 0's)."""


def _holder(path: pathlib.Path) -> str:
  # The holder writes its line just after locking: a start racing it may read an empty file first.
  for _ in range(50):
    text = path.read_text().strip() if path.exists() else ""
    if text:
      return text
    time.sleep(0.02)
  return "a process that has not written its pid yet"


def _in_use(workdir, path: pathlib.Path) -> str:
  return (f"workdir {workdir} is in use by another run ({_holder(path)}, which holds {path}); wait "
          "for it to end or stop it, or use another --workdir")


class RunLock:
  """An exclusive `fcntl.flock` on workdir/LOCK_FILE, holding "pid <pid> on host <host>".

  Raises WorkdirInUse naming the holder when another start has it. The lock lives as long as the
  open file: `release`, or the end of the process however it ends (SIGKILL included).
  """

  def __init__(self, workdir: pathlib.Path):
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    self.path = workdir / LOCK_FILE
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      raise WorkdirInUse(_in_use(workdir, self.path)) from None
    self.holder = f"pid {os.getpid()} on host {socket.gethostname()}"
    os.ftruncate(fd, 0)
    os.write(fd, (self.holder + "\n").encode())
    self._fd = fd

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


def lock_holder(workdir: pathlib.Path) -> str | None:
  """Who holds the workdir's lock (a run going on), None when nobody does: the lock is tried and let
  go at once, through a read-only descriptor, writing nothing."""
  path = pathlib.Path(workdir) / LOCK_FILE
  try:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
  except FileNotFoundError:
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(fd, fcntl.LOCK_UN)
    return None
  except BlockingIOError:
    return _holder(path)
  finally:
    os.close(fd)


def check_not_locked(workdir: pathlib.Path) -> None:
  """Raises WorkdirInUse on every process when another start holds the workdir's lock (process 0
  looks, `lock_holder`). Collective: all processes call it."""
  from lowcomm_jax import distributed  # pylint: disable=g-import-not-at-top
  refusal = None
  if distributed.is_primary() and lock_holder(workdir) is not None:
    refusal = _in_use(workdir, pathlib.Path(workdir) / LOCK_FILE)
  refusal = distributed.gather_lists([refusal] if distributed.is_primary() else [])[0]
  if refusal:
    raise WorkdirInUse(refusal)


def lock_run(workdir: pathlib.Path) -> RunLock | None:
  """Locks the workdir for a run of every process: process 0 takes the RunLock (returned; None
  elsewhere), the others check that the lock file they see names process 0 (one shared folder).

  Every process raises the same WorkdirInUse when either fails. Collective: all processes call it.
  """
  from lowcomm_jax import distributed  # pylint: disable=g-import-not-at-top
  lock, refusal = None, None
  if distributed.is_primary():
    try:
      lock = RunLock(workdir)
    except WorkdirInUse as error:
      refusal = str(error)
  refusal, holder = distributed.gather_lists(
      [[refusal, lock.holder if lock else None]] if distributed.is_primary() else [])[0]
  if refusal:
    raise WorkdirInUse(refusal)
  seen = holder if distributed.is_primary() else _holder(pathlib.Path(workdir) / LOCK_FILE)
  if not distributed.all_agree(seen == holder):
    if lock is not None:
      lock.release()
    raise WorkdirInUse(f"workdir {workdir}: process 0 locked it ({holder}) but another process "
                       "sees another lock file there; with several processes the workdir must be "
                       "one folder they all share")
  return lock


def write_config(workdir: pathlib.Path, config_json: dict, fingerprint: dict,
                 corpus_identity: str | None, inputs: dict | None = None,
                 kind: str = "train") -> None:
  """Creates the workdir and its config.json (the first file of a run), then copies the run's
  tokenizer into it (`run_inputs.copy_tokenizer`)."""
  workdir.mkdir(parents=True, exist_ok=True)
  write_atomic(workdir / "config.json", json.dumps(
      {"config": config_json, "fingerprint": fingerprint, "corpus_identity": corpus_identity,
       "kind": kind, "inputs": inputs}, indent=1, default=str))
  if inputs:
    run_inputs.copy_tokenizer(workdir, inputs)


def strict_json(value, path: str = "", reasons: dict | None = None):
  """`value` with every NaN/inf float replaced by None; `reasons[path]` says what it was."""
  if isinstance(value, dict):
    return {k: strict_json(v, f"{path}.{k}" if path else str(k), reasons) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict_json(v, f"{path}[{i}]", reasons) for i, v in enumerate(value)]
  if isinstance(value, float) and not math.isfinite(value):
    if reasons is not None:
      reasons[path] = f"was {value} (not a finite number)"
    return None
  return value


def write_summary(workdir: pathlib.Path, summary: dict, why_null: dict | None = None) -> dict:
  """Writes summary.json as strict JSON and returns what was written.

  `why_null` names the known cause of a value that is missing (e.g. tokens_per_s: "no timed step");
  a NaN/inf without one is reported as such under `null_reasons`.
  """
  reasons: dict = {}
  clean = strict_json(summary, reasons=reasons)
  for key, reason in (why_null or {}).items():  # the known cause beats "was nan" (key: its path)
    if key in reasons or clean.get(key, 0) is None:
      reasons[key] = reason
  if reasons:
    clean["null_reasons"] = reasons
  write_atomic(workdir / "summary.json", json.dumps(clean, indent=1, default=str, allow_nan=False))
  return clean


def report_complete(workdir: pathlib.Path) -> dict:
  """The saved summary of a finished run, with a line saying nothing was done."""
  summary = read_summary(workdir)
  print(f"the run in {workdir} is complete (summary.json is there); nothing to do, nothing changed",
        flush=True)
  return {**summary, "complete_before_start": True}
