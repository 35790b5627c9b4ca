"""What a run depends on, held by its workdir: a copy of its tokenizer and the identity of its data.

A run's first start copies the files of `data.tokenizer` into workdir/tokenizer/ (`copy_tokenizer`)
and saves their description in config.json under "inputs" (`describe`):

  {"tokenizer": {"given": data.tokenizer as given, "path": its file (absolute), "vocab_size": n,
                 "sha256": {file name: SHA-256, ...}},                  (no files for "bytes")
   "tokens": {"path": the ids file (absolute), "size": bytes,
              "sha256": the ids' SHA-256 as experiments/prepare_data.py recorded it}}
                                                                         (for a tokens: corpus)

A resume compares what it is given with the saved inputs (`difference`) and is refused, naming
both, when the tokenizer's files or the tokens file are not the run's any more. The tools that read
a run take its config from `run_config`: data.tokenizer is the workdir's copy (checked against its
SHA-256), so a tokenizer retrained, moved or relative to another current directory cannot change
what they decode; they say so in one line when data.tokenizer has changed since.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

from lowcomm_jax import config as config_lib
from lowcomm_jax.data import corpora, files, tokenizer as tokenizer_lib

# The workdir's folder holding the copy of the run's tokenizer files.
TOKENIZER_DIR = "tokenizer"
_NOTED: set = set()  # tokenizer files changed since their run, said once per process


def _hashes(tok) -> dict[str, str]:
  return {p.name: files.sha256_file(p) for p in tok.files()}


def describe(config) -> dict:
  """The inputs of a run of `config` as they are now (see the module docstring); reads the
  tokenizer's files and the tokens metadata, never a tokens file's ids."""
  tok = tokenizer_lib.load_tokenizer(config.data.tokenizer)
  tokenizer = {"given": str(config.data.tokenizer), "vocab_size": int(tok.vocab_size)}
  if tok.files():
    tokenizer.update(path=str(tok.files()[0]), sha256=_hashes(tok))
  inputs = {"tokenizer": tokenizer}
  if str(config.data.corpus).startswith("tokens:"):
    path, meta = files.token_metadata(config.data.corpus)
    inputs["tokens"] = {"path": str(path.resolve()), "size": path.stat().st_size,
                        "sha256": meta.get("sha256")}
  return inputs


def copy_tokenizer(workdir: pathlib.Path, inputs: dict) -> None:
  """Copies the tokenizer's files `inputs` describes into workdir/TOKENIZER_DIR (each written whole,
  then renamed; a copy already there with its SHA-256 is kept, so a start cut short before copying
  copies at its resume). Raises when a file is no longer the one described."""
  tokenizer = inputs["tokenizer"]
  folder = pathlib.Path(workdir) / TOKENIZER_DIR
  source = pathlib.Path(tokenizer.get("path", "")).parent
  for name, sha in tokenizer.get("sha256", {}).items():
    copy = folder / name
    if copy.is_file() and files.sha256_file(copy) == sha:
      continue
    data = (source / name).read_bytes()
    if hashlib.sha256(data).hexdigest() != sha:
      raise ValueError(f"data.tokenizer={tokenizer['given']!r}: {source / name} changed while the "
                       "run started; start again once it is written")
    folder.mkdir(parents=True, exist_ok=True)
    with files.new_file(copy) as tmp:
      tmp.write_bytes(data)


def _short(sha: str | None) -> str:
  return f"sha256 {sha[:12]}" if sha else "no recorded sha256"


def difference(workdir: pathlib.Path, saved: dict | None, current: dict) -> str | None:
  """One line naming the run's input and the given one where they differ (None when they match, or
  for a run saved without inputs: its corpus identity compares names and sizes)."""
  if not saved:
    return None
  then, now = saved.get("tokenizer", {}), current["tokenizer"]
  if now and then.get("sha256", {}) != now.get("sha256", {}):
    run_files = ", ".join(f"{n} {_short(h)}" for n, h in then.get("sha256", {}).items()) or "bytes"
    given = ", ".join(f"{n} {_short(h)}" for n, h in now.get("sha256", {}).items()) or "bytes"
    return (f"data.tokenizer={now['given']!r} is not the tokenizer the run in {workdir} trained "
            f"with: the run's is {run_files} ({then.get('vocab_size')} tokens, copied to "
            f"{pathlib.Path(workdir) / TOKENIZER_DIR}), the given one is {given} "
            f"({now.get('vocab_size')} tokens); resume with the run's tokenizer (e.g. "
            f"data.tokenizer={str(pathlib.Path(workdir) / TOKENIZER_DIR)!r}), or use a new "
            "--workdir")
  then, now = saved.get("tokens"), current.get("tokens")
  if then and now and (then["size"], then["sha256"]) != (now["size"], now["sha256"]):
    return (f"data.corpus='tokens:{now['path']}' is not the file the run in {workdir} trained on: "
            f"the run's was {then['path']} of {then['size']} bytes, {_short(then['sha256'])}; the "
            f"file now has {now['size']} bytes, {_short(now['sha256'])} (rewritten since); resume "
            "with the run's tokens file, or use a new --workdir")
  return None


def data_note(workdir, config) -> str | None:
  """For a reader of a run on its own `data.corpus`: one line naming the run's and the current
  identity of that data when they differ (its files or their sizes, or the tokens file's hash)."""
  saved = json.loads((pathlib.Path(workdir) / "config.json").read_text())
  if saved.get("config", {}).get("data", {}).get("corpus") != config.data.corpus:
    return None
  changed = difference(workdir, saved.get("inputs"), {**describe(config), "tokenizer": {}})
  now = corpora.corpus_identity(config.data.corpus, config.data.tokenizer)
  if changed is None and saved.get("corpus_identity") not in (None, now):
    changed = (f"data.corpus={config.data.corpus!r} is not the text the run in {workdir} trained "
               f"on (corpus identity {saved['corpus_identity']} then, {now} now: its files or "
               "their sizes changed)")
  if changed is None:
    return None
  return f"note: {changed.split('; resume')[0]}; scored on it as it is now"


def saved_inputs(workdir) -> dict | None:
  """The "inputs" of a run's config.json (None for a run saved before runs recorded them)."""
  return json.loads((pathlib.Path(workdir) / "config.json").read_text()).get("inputs")


def run_config(workdir, option: str = "--workdir"):
  """The config a run was started with, data.tokenizer set to the workdir's copy (checked against
  the SHA-256 recorded at the run's start), for the tools that read the run. A run saved before
  runs copied their tokenizer keeps data.tokenizer as given."""
  workdir = pathlib.Path(workdir)
  c = config_lib.load_run_config(workdir)
  tokenizer = (saved_inputs(workdir) or {}).get("tokenizer", {})
  if "sha256" not in tokenizer:
    return c
  folder = workdir.resolve() / TOKENIZER_DIR
  for name, sha in tokenizer["sha256"].items():
    copy = folder / name
    if not copy.is_file() or files.sha256_file(copy) != sha:
      why = "is missing" if not copy.is_file() else "differs from its SHA-256 at the run's start"
      raise ValueError(f"{option}={str(workdir)!r}: the run's copy of its tokenizer {copy} {why}; "
                       f"restore it (the run trained with data.tokenizer={tokenizer['given']!r}, "
                       f"{name} {_short(sha)})")
  main = pathlib.Path(tokenizer["path"]).name
  given = pathlib.Path(tokenizer["path"])
  if (given.is_file() and files.sha256_file(given) != tokenizer["sha256"][main]
      and given not in _NOTED):
    _NOTED.add(given)
    print(f"note: data.tokenizer={tokenizer['given']!r} ({given}) has changed since the run "
          f"started ({_short(files.sha256_file(given))} now, {_short(tokenizer['sha256'][main])} "
          f"then); the run's copy {folder / main} is used", file=sys.stderr, flush=True)
  c.data.tokenizer = str(folder / main)
  return c
