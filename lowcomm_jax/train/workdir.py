"""The run directory: what a start may find there, checked before anything is written.

A workdir is one of three things, and a start behaves accordingly:

- new (absent or empty): the run starts at step 0 and writes config.json first;
- a run of the same config (its config.json's fingerprint and corpus identity match): it resumes
  from the latest checkpoint, or, when summary.json is there, says the run is complete and changes
  nothing;
- anything else (a file, an unwritable place, another config, a different corpus, run files without
  config.json, an unreadable config.json): one ValueError naming what is wrong and what to do,
  and the directory is left byte for byte as it was.

summary.json is strict JSON: a value that is NaN or inf becomes null, and `null_reasons` says why.
"""

from __future__ import annotations

import json
import math
import pathlib
import tempfile

# Files and folders a run writes; any of them without config.json is a damaged or foreign run.
RUN_FILES = ("checkpoints", "checkpoints_unreadable", "metrics.jsonl", "summary.json", "tensorboard")
NEW, RESUME, COMPLETE = "new", "resume", "complete"


def check_path(workdir) -> pathlib.Path:
  """The workdir as a path; raises unless it is (or can become) a writable directory."""
  if workdir is None or not str(workdir).strip():
    raise ValueError("--workdir must name a directory (a new one, or a run to resume), got an empty "
                     "path; a run is never written into the current directory by default")
  path = pathlib.Path(workdir)
  if path.exists() and not path.is_dir():
    raise ValueError(f"--workdir={workdir} is a file; give a directory (new, or a run to resume)")
  existing = path
  while not existing.exists():
    existing = existing.parent
  if not existing.is_dir():
    raise ValueError(f"--workdir={workdir} cannot be created: {existing} is a file")
  try:  # os.access says yes to root everywhere; a real (removed at once) file says the truth
    with tempfile.TemporaryFile(dir=existing):
      pass
  except OSError as error:
    raise ValueError(f"--workdir={workdir} cannot be written: {existing} refuses new files "
                     f"({type(error).__name__}: {error.strerror}); give a writable directory") from None
  return path


def read_run(workdir: pathlib.Path) -> dict | None:
  """config.json of a run directory; None for a new one. Raises for run files without it, or a
  config.json that is not what a run writes."""
  saved = workdir / "config.json"
  if not saved.exists():
    found = sorted(name for name in RUN_FILES if (workdir / name).exists())
    if found:
      raise ValueError(f"workdir {workdir} holds {', '.join(found)} but no config.json, so which run "
                       "they belong to is unknown; refusing to resume or overwrite them: use a new "
                       "--workdir (or restore that run's config.json)")
    return None
  try:
    run = json.loads(saved.read_text())
    if not isinstance(run, dict) or not isinstance(run.get("fingerprint"), dict):
      raise ValueError("no 'fingerprint' object")
  except (ValueError, UnicodeDecodeError) as error:
    raise ValueError(f"workdir {workdir} has a config.json that cannot be read ({error}); it is not "
                     "the file a run writes: use a new --workdir, or restore that file") from None
  return run


def check_workdir(workdir: pathlib.Path, fingerprint: dict, defaults: dict | None = None,
                  corpus_identity: str | None = None) -> str:
  """NEW, RESUME or COMPLETE for a start of the run `fingerprint` in `workdir`; raises otherwise.

  A key the saved run does not know (added to the config since) counts as its default value; a key
  it saved that is fingerprinted no more (e.g. diloco.nonfinite, now the run-time key nonfinite) is not compared. A saved
  corpus identity (`lowcomm_jax.data.corpora.corpus_identity`) must equal `corpus_identity`, so a
  resume never trains on other text (another Python's stdlib, another Debian release) unnoticed.
  Reads only: an existing run directory is never changed by a refused start.
  """
  run = read_run(pathlib.Path(workdir))
  if run is None:
    return NEW
  current = json.loads(json.dumps(fingerprint, default=str))
  defaults = json.loads(json.dumps(defaults or {}, default=str))
  # A saved key fingerprinted no more (now a run-time key, or gone from the config) is not compared.
  previous = {k: v for k, v in run["fingerprint"].items() if k in current or k in defaults}
  for key, value in defaults.items():
    previous.setdefault(key, value)
  differing = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
  if differing:
    details = ", ".join(f"{k}: {previous.get(k)!r} -> {current.get(k)!r}" for k in differing[:8])
    raise ValueError(f"workdir {workdir} holds a run of another config ({details}); "
                     "use a new --workdir or the same config to resume")
  saved_identity = run.get("corpus_identity")
  if saved_identity and corpus_identity and saved_identity != corpus_identity:
    raise ValueError(
        f"workdir {workdir} was trained on another copy of data.corpus={run['config']['data']['corpus']!r} "
        f"(corpus identity {saved_identity}, here {corpus_identity}: its files or their sizes differ, "
        "e.g. another Python version or Debian release); resuming would train on other text: "
        "resume where the run started, or use a new --workdir")
  return COMPLETE if (pathlib.Path(workdir) / "summary.json").exists() else RESUME


def write_config(workdir: pathlib.Path, config_json: dict, fingerprint: dict,
                 corpus_identity: str | None) -> None:
  """Creates the workdir and its config.json (the first file of a run)."""
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(json.dumps(
      {"config": config_json, "fingerprint": fingerprint, "corpus_identity": corpus_identity},
      indent=1, default=str))


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
  for key, reason in (why_null or {}).items():  # the known cause beats "was nan"
    if key in clean and clean[key] is None:
      reasons[key] = reason
  if reasons:
    clean["null_reasons"] = reasons
  (workdir / "summary.json").write_text(json.dumps(clean, indent=1, default=str, allow_nan=False))
  return clean


def report_complete(workdir: pathlib.Path) -> dict:
  """The saved summary of a finished run, with a line saying nothing was done."""
  summary = json.loads((workdir / "summary.json").read_text())
  print(f"the run in {workdir} is complete (summary.json is there); nothing to do, nothing changed",
        flush=True)
  return {**summary, "complete_before_start": True}
