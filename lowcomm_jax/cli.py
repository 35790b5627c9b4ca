"""Runs an `experiments/` binary's absl main with a user's mistakes refused in one line.

`run(main)` replaces `absl.app.run(main)`. What the user typed is checked before `main` starts:

  * flags absl refuses (an unknown flag, a missing required one, a value of the wrong type);
  * a `--config` file flag (ml_collections `DEFINE_config_file`) given an empty string, a path that
    does not exist or is a folder, a file that is not Python or defines no `get_config`, a
    `get_config` that refuses its variant;
  * a `--config.<key>` override naming no key of the config (the closest keys are suggested), or
    a value its type refuses.

A `ValueError` (the project's "bad input" error) or `absl.app.UsageError` raised by `main` itself
is shown the same way.
Each becomes one line on stderr, `ValueError: <option>: <what is wrong and what is allowed>`, and
exit status 1, with no traceback; nothing of the run has started.
"""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import os
import re
import sys
from typing import Callable, Sequence

import ml_collections
from absl import app, flags
from ml_collections.config_flags import config_flags

from lowcomm_jax import config as config_lib


def fail(message: str):
  """Ends the process with `message` as one line on stderr (exit status 1)."""
  sys.exit(f"ValueError: {' '.join(str(message).split())}")


def _flag_argument(argv: Sequence[str], name: str) -> str | None:
  """The value given to --name (or -name) in `argv`, the last one when repeated; None if absent."""
  value = None
  for i, arg in enumerate(argv):
    if arg == "--":
      break
    for prefix in (f"--{name}", f"-{name}"):
      if arg == prefix and i + 1 < len(argv):
        value = argv[i + 1]
      elif arg.startswith(prefix + "="):
        value = arg[len(prefix) + 1:]
  return value


def _overrides(argv: Sequence[str], name: str) -> list[str]:
  """The dotted keys of the --name.<key>[=value] overrides in `argv` (--noname.<key> sets a bool
  key to False), as ml_collections finds them."""
  keys = []
  for arg in argv:
    if arg == "--":
      break
    match = re.match(rf"-{{1,2}}(no)?{re.escape(name)}\.([^=]*)", arg)
    if match:
      keys.append(match.group(2))
  return keys


def _flat_keys(c, prefix: str = "") -> list[str]:
  keys = []
  for key, value in c.items():
    keys.append(prefix + key)
    if isinstance(value, ml_collections.ConfigDict):
      keys.extend(_flat_keys(value, f"{prefix}{key}."))
  return keys


def _short(error: BaseException) -> str:
  if isinstance(error, SyntaxError):
    return f"SyntaxError: {error.msg} (line {error.lineno})"
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[-1] if text else ''}".rstrip(": ")


def load_config_file(name: str, spec: str):
  """The ConfigDict of `--name=spec` (path[:variant]) as ml_collections loads it, or `fail`s naming
  the flag: the same file, the same `get_config(variant)` call, checked step by step."""
  allowed = "a config file path[:variant] such as experiments/configs/diloco.py:tiny"
  if not spec:
    fail(f"--{name} must be {allowed}, got an empty string")
  path, _, variant = spec.partition(":")
  if not path:
    fail(f"--{name}={spec}: the path before ':' is empty; give {allowed}")
  if os.path.isdir(path):
    fail(f"--{name}={spec}: {path} is a folder; give {allowed}")
  if not os.path.isfile(path):
    fail(f"--{name}={spec}: no such file {path}; give {allowed}")
  # As ml_collections loads it: any file name, run as Python source.
  loader = importlib.machinery.SourceFileLoader(f"{name}_config_check", path)
  module_spec = importlib.util.spec_from_loader(loader.name, loader)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except Exception as error:  # pylint: disable=broad-except  # any error of the user's file
    fail(f"--{name}={spec}: {path} is not a config file that Python runs ({_short(error)}); give "
         f"{allowed}")
  if not callable(getattr(module, "get_config", None)):
    fail(f"--{name}={spec}: {path} defines no get_config(); a config file returns its ConfigDict "
         f"from get_config() or get_config(variant)")
  try:
    config = module.get_config(*([variant] if ":" in spec else []))
  except AttributeError as error:  # e.g. c.diloco.sync_every = 10 of a config written before
    moved = config_lib.moved_key_error(str(error).strip("\"'"))
    if moved:
      fail(f"--{name}={spec}: get_config({variant!r}) of {path} sets a key that moved: {moved}")
    fail(f"--{name}={spec}: get_config({variant!r}) of {path} failed: {_short(error)}")
  except Exception as error:  # pylint: disable=broad-except
    fail(f"--{name}={spec}: get_config({variant!r}) of {path} failed: {_short(error)}")
  if not isinstance(config, ml_collections.ConfigDict):
    fail(f"--{name}={spec}: get_config() of {path} returned {type(config).__name__}, not a "
         f"ConfigDict")
  return config


def check_overrides(name: str, config, keys: Sequence[str]) -> None:
  """`fail`s on the first --name.<key> that names no key of `config`, with the closest keys."""
  known = _flat_keys(config)
  for key in keys:
    if key in known:
      continue
    moved = config_lib.moved_key_error(key)
    if moved:
      fail(f"--{name}.{key}: {moved}")
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = ("did you mean " + " or ".join(f"--{name}.{k}" for k in close) + "?") if close else (
        "the keys and their allowed values are listed in lowcomm_jax/config.py")
    fail(f"--{name}.{key}: the config has no key {key!r}; {hint}")


def _config_flag_names(flag_values: flags.FlagValues) -> list[str]:
  return [name for name in flag_values
          if config_flags.is_config_flag(flag_values[name]) and name == flag_values[name].name]


def parse_flags(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
  """absl's flag parsing with every refusal as one line (`run`'s `flags_parser`)."""
  argv = list(argv)
  for name in _config_flag_names(flag_values):
    spec = _flag_argument(argv[1:], name)
    if spec is not None:
      check_overrides(name, load_config_file(name, spec), _overrides(argv[1:], name))
  try:
    rest = flag_values(argv)
  except flags.Error as error:
    fail(error)
  except Exception as error:  # pylint: disable=broad-except  # e.g. an override's value of another type
    fail(f"bad flag value: {_short(error)}")
  for name in _config_flag_names(flag_values):
    try:
      value = flag_values[name].value
      if value is not None:
        value.get("")  # raises the load error ml_collections deferred, if any
    except Exception as error:  # pylint: disable=broad-except
      fail(f"--{name}: {_short(error)}")
  return rest


def run(main: Callable[[list[str]], object]) -> None:
  """`absl.app.run(main)`, with flag and config-file mistakes and `main`'s ValueErrors in one
  line."""

  def guarded(argv):
    try:
      return main(argv)
    except (ValueError, app.UsageError) as error:
      fail(error)

  app.run(guarded, flags_parser=parse_flags)
