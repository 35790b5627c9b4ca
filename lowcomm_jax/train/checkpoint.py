"""Orbax checkpoints of the train state and the data iterator's state, each sealed by a checksum."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import sys
import tempfile
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from lowcomm_jax import distributed
from lowcomm_jax.data import files, tokenizer as tokenizer_lib
from lowcomm_jax.train import run_inputs, workdir as workdir_lib

_HANDLER_REGISTERED = False
# Written last into a step directory: the SHA-256 of every other file of the step.
CHECKSUM_FILE = "lowcomm_sha256.json"
# How long a failed save's remaining writes are given to end before the run stops.
_IN_FLIGHT_WRITES_S = 1.0
# How long a reader of a live run (its lock held) waits for the next sealed step when none it
# listed restores (the rotation, keep, removes the step being read once the next is written).
_ROTATION_WAIT_S = 30.0


def _one_line_orbax_errors(record: logging.LogRecord) -> bool:
  """Logs orbax's errors (and asyncio's about orbax's tasks) as their first line: a failed save is
  reported by SaveFailed, once; each of orbax's threads logging its traceback would bury that
  line."""
  orbax = f"{os.sep}orbax{os.sep}"
  frames, tb = [], record.exc_info[2] if record.exc_info else None
  while tb is not None:
    frames.append(tb.tb_frame.f_code.co_filename)
    tb = tb.tb_next
  if record.levelno >= logging.ERROR and (orbax in record.pathname or (
      record.name == "asyncio" and any(orbax in f for f in [record.getMessage(), *frames]))):
    record.msg = f"orbax: {record.getMessage().splitlines()[0][:300]}"
    record.args, record.exc_info, record.exc_text = (), None, None
  return True


def _quiet_closed_loop_reports(previous):
  """sys.unraisablehook, but for the reports of tensorstore writes that end after a failed save
  closed orbax's event loop: each printed a traceback ("Event loop is closed"), dozens for one
  full disk, burying the one line SaveFailed gives. Likewise the reads of a restore that failed (a
  step a live run's rotation removed while read): the restore's own error is reported, once."""

  def hook(unraisable):
    last = unraisable.exc_traceback
    while last is not None and last.tb_next is not None:
      last = last.tb_next
    closed_loop = (unraisable.exc_type is RuntimeError
                   and str(unraisable.exc_value) == "Event loop is closed"
                   and last is not None and last.tb_frame.f_code.co_name == "_check_closed")
    code = getattr(unraisable.object, "cr_code", None)
    orbax_read = code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
    if not (closed_loop or orbax_read):
      previous(unraisable)

  return hook


def _not_the_override_warning(record: logging.LogRecord) -> bool:
  return not record.getMessage().startswith("Type handler registry")


def _fast_array_handler() -> None:
  # Replica-parallel writes make the first save take 4-26 s on CPU; one writer is enough here.
  global _HANDLER_REGISTERED
  if not _HANDLER_REGISTERED:
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(_not_the_override_warning)  # the override is the point: no warning line
    try:
      ocp.type_handlers.register_type_handler(
          jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
    finally:
      absl_logger.removeFilter(_not_the_override_warning)
    logging.getLogger("absl").addFilter(_one_line_orbax_errors)
    logging.getLogger("asyncio").addFilter(_one_line_orbax_errors)
    sys.unraisablehook = _quiet_closed_loop_reports(sys.unraisablehook)
    _HANDLER_REGISTERED = True


class DamagedCheckpoint(ValueError):
  """A step directory whose files are not the ones its save wrote."""


class SaveFailed(RuntimeError):
  """A checkpoint could not be written (disk full, a read-only or vanished folder): the run
  stops."""


def os_error_of(error: BaseException) -> str:
  """The operating system's words in an error of a write: "EFBIG (File too large) writing <path>"
  from tensorstore's long messages, the first line of any other."""
  if isinstance(error, OSError) and error.errno:
    where = f" on {error.filename}" if error.filename else ""
    return f"{errno.errorcode.get(error.errno, error.errno)} ({error.strerror}){where}"
  text = str(error)
  code = re.search(r"os_error_code='(\d+)'", text)
  path = re.findall(r'"(/[^"]+)"', text)
  if code:
    number = int(code.group(1))
    return (f"{errno.errorcode.get(number, number)} ({os.strerror(number)})"
            + (f" writing {path[-1]}" if path else ""))
  return f"{type(error).__name__}: {(text or '?').splitlines()[0][:300]}"


def file_digests(step_dir: pathlib.Path) -> dict[str, str]:
  """SHA-256 of every file under `step_dir` (but the checksum file), by relative path."""
  return {str(path.relative_to(step_dir)): files.sha256_file(path)
          for path in sorted(p for p in step_dir.rglob("*") if p.is_file())
          if path.name != CHECKSUM_FILE or path.parent != step_dir}


def run_identity(workdir: pathlib.Path) -> str | None:
  """What binds a checkpoint to its run: the SHA-256 of the fingerprint and corpus identity saved in
  the workdir's config.json (written once, at the run's start); None without a config.json."""
  try:
    saved = json.loads((pathlib.Path(workdir) / "config.json").read_text())
  except FileNotFoundError:
    return None
  bound = {"fingerprint": saved.get("fingerprint"), "corpus_identity": saved.get("corpus_identity")}
  return hashlib.sha256(json.dumps(bound, sort_keys=True, default=str).encode()).hexdigest()


def seal(step_dir: pathlib.Path) -> None:
  """Writes the checksum file of a finished step (atomically: a torn write is no checksum): the
  SHA-256 of its files, its step and the run it belongs to (`run_identity` of its workdir)."""
  tmp = step_dir / (CHECKSUM_FILE + ".tmp")
  tmp.write_text(json.dumps({"sha256": file_digests(step_dir), "step": int(step_dir.name),
                             "run": run_identity(step_dir.parent.parent)}, indent=1))
  tmp.rename(step_dir / CHECKSUM_FILE)


def verify(step_dir: pathlib.Path) -> None:
  """Raises DamagedCheckpoint unless the step directory is the one its save sealed, here: sealed
  for this step number and by this workdir's run, and no file missing, added or changed."""
  try:
    sealed = json.loads((step_dir / CHECKSUM_FILE).read_text())
    expected, sealed_step, sealed_run = sealed["sha256"], sealed.get("step"), sealed.get("run")
  except FileNotFoundError:
    raise DamagedCheckpoint(f"{CHECKSUM_FILE} is missing: the save never finished, or the step "
                            "was copied without it") from None
  except (ValueError, KeyError, TypeError) as error:
    raise DamagedCheckpoint(f"{CHECKSUM_FILE} is unreadable ({error})") from None
  if sealed_step != int(step_dir.name):
    raise DamagedCheckpoint(f"it was saved as step {sealed_step}, not {step_dir.name} (a renamed "
                            "or copied step directory)")
  if sealed_run != run_identity(step_dir.parent.parent):
    raise DamagedCheckpoint(f"it was saved by another run (run {str(sealed_run)[:12]}, this "
                            f"workdir's config.json is "
                            f"run {str(run_identity(step_dir.parent.parent))[:12]}): a step "
                            f"copied from another run or config")
  actual = file_digests(step_dir)
  for name in sorted(set(expected) | set(actual)):
    if name not in actual:
      raise DamagedCheckpoint(f"file {name} is missing")
    if name not in expected:
      raise DamagedCheckpoint(f"file {name} was not written by the save")
    if actual[name] != expected[name]:
      raise DamagedCheckpoint(f"file {name} differs from its SHA-256 at save time")


def check_writable(workdir: pathlib.Path) -> None:
  """Raises SaveFailed on every process unless process 0 can write a file into workdir/checkpoints
  (made if absent): called before the first step, as a run that cannot save must not train."""
  directory = pathlib.Path(workdir).absolute() / "checkpoints"
  refusal = None
  if distributed.is_primary():
    try:
      directory.mkdir(exist_ok=True)
      with tempfile.TemporaryFile(dir=directory) as probe:
        probe.write(b"lowcomm_jax: can checkpoints be written here?\n")
        probe.flush()
        os.fsync(probe.fileno())
    except OSError as error:
      refusal = (f"checkpoints cannot be written in {directory}: {os_error_of(error)}; nothing was "
                 "trained: make it a writable folder with room, then rerun the same command")
  if not distributed.all_agree(refusal is None):
    raise SaveFailed(distributed.gather_lists([refusal] if distributed.is_primary() else [])[0])


class Checkpointer:
  """The training's checkpoints (it holds the workdir's lock): saves every `every` steps under
  workdir/checkpoints; restores the latest intact one, setting aside those that do not restore.
  A tool that reads a run uses `read_latest` instead, which changes nothing.

  A save is written to a temporary directory and renamed when every process has finished it, so a
  run killed mid-save leaves no step directory (its leftovers are removed at the next start). Once
  renamed, process 0 seals it with the SHA-256 of each of its files, its step and its run
  (CHECKSUM_FILE, written last, by a thread, so saves stay asynchronous). A restore verifies every
  file first: a step damaged afterwards (a flipped bit, a truncated or deleted file, edited JSON
  of the data iterator), never sealed, renamed, or copied from another run is moved to
  workdir/checkpoints_unreadable/ with a log line naming it and the file (or what it was sealed
  as), and the previous one is restored instead.
  """

  def __init__(self, workdir: pathlib.Path, keep: int):
    _fast_array_handler()
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    self.unreadable = self.directory.parent / "checkpoints_unreadable"
    self._failure = None  # (step, error) of a save that failed, seen by process 0's sealer
    self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True))
    self._sealer = None  # process 0's thread that seals the step whose save is in flight
    self._closed = False

  def check(self, saving: bool) -> None:
    """Raises SaveFailed on every process once a save failed: at once (any step) alone, at the
    next save with several processes (where they agree on it)."""
    if jax.process_count() > 1 and not saving:
      return
    if distributed.all_agree(self._failure is None):
      return
    failed = distributed.gather_lists([self._failure_message()] if distributed.is_primary() else [])
    self._abandon()
    raise SaveFailed(failed[0])

  def _failure_message(self) -> str:
    step, error = self._failure
    sealed = [int(p.name) for p in self.directory.iterdir()
              if p.name.isdigit() and int(p.name) < step and (p / CHECKSUM_FILE).is_file()]
    intact = (f"checkpoint step {max(sealed)} ({self.directory / str(max(sealed))}) is intact: "
              f"rerun the same command to resume from "
              f"it" if sealed else "no earlier checkpoint: a rerun "
              "starts at step 0")
    return (f"checkpoint step {step} could not be saved in {self.directory}: {os_error_of(error)}; "
            f"the run stopped; {intact} once the folder is writable and has room")

  def _abandon(self) -> None:
    # Close what close() would; none of it may raise now. The failed save's other writes, still in
    # flight, end meanwhile (a full disk fails them at once); they are given the time to, while
    # the hook that quiets their reports is there (_quiet_closed_loop_reports).
    self._closed = True
    self._join_sealer()
    for close in (self.manager.wait_until_finished, self.manager.close):
      try:
        close()
      except Exception:  # pylint: disable=broad-except
        pass
    time.sleep(_IN_FLIGHT_WRITES_S)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict) -> None:
    self._join_sealer()
    self.check(saving=True)
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))
    if distributed.is_primary():  # orbax renames the step once every process has written its part
      self._sealer = threading.Thread(target=self._seal_when_written, args=(step,), daemon=True,
                                      name=f"seal checkpoint {step}")
      self._sealer.start()

  def wait(self) -> None:
    """Returns once the last save is written and sealed (raises SaveFailed if it failed)."""
    self._join_sealer()
    self.check(saving=True)

  def _seal_when_written(self, step: int) -> None:
    try:
      self.manager.wait_until_finished()
      if (self.directory / str(step)).is_dir():
        seal(self.directory / str(step))
    except Exception as error:  # pylint: disable=broad-except
      self._failure = (step, error)  # the training loop stops at its next check

  def _join_sealer(self) -> None:
    if self._sealer is not None:
      self._sealer.join()
      self._sealer = None

  def restore(self, step: int, abstract_state):
    verify(self.directory / str(step))
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return restored["state"], restored["data"]

  def restore_latest(self, abstract_state):
    """(step, state, data) of the newest checkpoint every process can read; None if there is
    none."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        restored, reason = self.restore(step, abstract_state), ""
      except Exception as error:  # pylint: disable=broad-except
        # orbax and tensorstore raise many kinds of error for missing or truncated files
        restored, reason = (
          None,
          f"{type(error).__name__}: {(str(error) or '?').splitlines()[0][:200]}",
        )
      if distributed.all_agree(restored is not None):
        return (step, *restored)
      print(f"checkpoint step {step} in {self.directory} cannot be restored "
            f"({reason or 'unreadable on another process'}); moved to {self.unreadable}/, "
            "restoring the previous complete one", flush=True)
      self._set_aside(step)
    return None

  def _set_aside(self, step: int) -> None:
    if distributed.is_primary():
      self.unreadable.mkdir(exist_ok=True)
      target = self.unreadable / str(step)
      suffix = 0
      while target.exists():
        suffix += 1
        target = self.unreadable / f"{step}.{suffix}"
      (self.directory / str(step)).rename(target)
    distributed.barrier(f"set aside checkpoint {step}")
    self.manager.reload()

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    self._join_sealer()
    self.check(saving=True)
    self.manager.wait_until_finished()
    distributed.barrier("checkpoints sealed")  # no process ends before the last step is sealed
    self.manager.close()


def sealed_steps(directory: pathlib.Path) -> list[int]:
  """The step directories holding their checksum file (sealed saves), newest first."""
  try:
    names = [p.name for p in pathlib.Path(directory).iterdir()]
  except FileNotFoundError:
    return []
  sealed = [int(n) for n in names if n.isdigit() and (directory / n / CHECKSUM_FILE).is_file()]
  return sorted(sealed, reverse=True)


def _leaf_shapes(tree) -> dict[str, tuple]:
  # Paths as their names only: the template's TrainState attributes and orbax's saved dict keys.
  return {"/".join(re.findall(r"\w+", jax.tree_util.keystr(path))): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(leaf, "shape")}


def _shape_difference(step_dir: pathlib.Path, abstract_state, tokenizer: str) -> str | None:
  """What the step's saved shapes say against `abstract_state`'s (None when they agree or cannot be
  read): the vocabulary first, the likely cause (a tokenizer changed since the run)."""
  absl_logger = logging.getLogger("absl")
  absl_logger.disabled = True  # orbax warns about the step's own metadata file; it is not needed
  try:
    saved = _leaf_shapes(ocp.StandardCheckpointer().metadata(step_dir / "state").item_metadata)
  except Exception:  # pylint: disable=broad-except
    return None
  finally:
    absl_logger.disabled = False
  expected = _leaf_shapes(abstract_state)
  differing = [k for k in expected if k in saved and saved[k] != expected[k]]
  embed = [k for k in differing if k.split("/")[-1] == "embed"]
  if embed:
    rows, now = saved[embed[0]][-2], expected[embed[0]][-2]
    return (f"the run trained with an embedding of {rows:,} rows (a vocabulary of at most {rows:,} "
            f"tokens); data.tokenizer={tokenizer!r} now has {_vocabulary(tokenizer)} ({now:,} "
            "rows): it was changed since; restore the tokenizer file the run trained with")
  if differing:
    return (f"its {differing[0]} has shape {list(saved[differing[0]])}, the run's config.json "
            f"gives {list(expected[differing[0]])}")
  return None


def _vocabulary(tokenizer: str) -> str:
  try:
    return f"{tokenizer_lib.load_tokenizer(tokenizer).vocab_size:,} tokens"
  except ValueError:
    return "another vocabulary"


def read_latest(workdir, abstract_state, option: str = "--workdir", tokenizer: str = "") -> tuple:
  """(step, state, data) of the newest sealed checkpoint of a run that restores, read only: no
  orbax manager, no temporary folder cleaned, no step set aside, so that a training running in the
  workdir (or its finished files) is left as it is. In a live run (its lock held), a step removed
  while read (the rotation, keep) is followed by the next one sealed. Raises one ValueError naming
  `option` and the cause (e.g. a vocabulary other than the run's, `tokenizer` being
  data.tokenizer) when none restores. Collective with several processes: process 0's listing is
  read by all."""
  _fast_array_handler()
  directory = pathlib.Path(workdir).absolute() / "checkpoints"
  reader = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  failed: dict[int, str] = {}
  deadline = time.monotonic() + _ROTATION_WAIT_S
  try:
    while True:
      listed = distributed.gather_lists([sealed_steps(directory)] if distributed.is_primary()
                                        else [])[0]
      untried = [step for step in listed if step not in failed]
      for step in untried:
        restored, reason = None, None
        try:
          verify(directory / str(step))
          # Shapes first: a restore into other shapes leaves orbax's reads to fail at exit.
          reason = _shape_difference(directory / str(step), abstract_state, tokenizer)
          if reason is None:
            restored = reader.restore(directory / str(step), args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except Exception as error:  # pylint: disable=broad-except
          # orbax and tensorstore raise many kinds of error for missing or truncated files
          reason = f"{type(error).__name__}: {(str(error) or '?').splitlines()[0][:200]}"
        if distributed.all_agree(restored is not None):
          return step, restored["state"], restored["data"]
        failed[step] = reason or "unreadable on another process"
      # A live run's rotation removes the step being read once the next is written: wait for it.
      live = workdir_lib.lock_holder(directory.parent) is not None
      if not distributed.all_agree(not untried and live and time.monotonic() < deadline):
        if untried:
          continue
        break
      time.sleep(0.05)
  finally:
    reader.close()
  where = f"{option}={str(workdir)!r}"
  if not failed:
    raise ValueError(f"{where} has no sealed checkpoint in {directory} (the run has not saved its "
                     "first step yet)")
  newest = sorted(failed, reverse=True)
  causes = [failed[newest[0]]] if len(set(failed.values())) == 1 else [
      f"step {step}: {failed[step]}" for step in newest[:3]]
  raise ValueError(f"{where}: no checkpoint restores ({len(failed)} sealed, newest step "
                   f"{newest[0]}): {'; '.join(causes)}; nothing was changed")


def read_step(workdir, step: int) -> dict:
  """The state saved at sealed step `step` of `workdir` as saved (numpy leaves), read only (no
  orbax manager: nothing in the workdir changes)."""
  _fast_array_handler()
  step_dir = pathlib.Path(workdir).absolute() / "checkpoints" / str(step)
  verify(step_dir)
  reader = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  try:
    restored = reader.restore(step_dir, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  finally:
    reader.close()
  return jax.tree.map(np.asarray, dict(restored["state"]))


def restore_eval_params(workdir, replica: int | None = None, option: str = "init_from") -> tuple:
  """(model config, evaluated parameters) of the latest intact checkpoint of a run, as sharded
  global arrays.

  The evaluated parameters are what the run evaluates: replica 0's (DiLoCo after its last outer
  step: all replicas equal), the global φ, or NoLoCo's mean slow weights (`eval_params`); with
  `replica`, that replica's own current parameters θ_i instead. Reads the run's config.json and
  checkpoints only, and writes nothing. The train state is restored laid out as that run laid it
  out (its mesh over this job's devices, its sharding layout), so no device holds more of it than
  the run's own devices did, and the parameters come out sharded by the run's layout. `option`
  names the flag or key that gave `workdir` in the errors. The run is read only (`read_latest`),
  with its own copy of its tokenizer (`run_inputs.run_config`).
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from lowcomm_jax import config as config_lib, mesh as mesh_lib, sharding  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.models import llama  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.optim.inner import TrainState  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import algorithms, sources  # pylint: disable=g-import-not-at-top
  workdir = pathlib.Path(workdir)
  if not (workdir / "config.json").is_file() or not (workdir / "checkpoints").is_dir():
    raise ValueError(f"{option}={str(workdir)!r} holds no config.json and checkpoints/ of a run")
  try:
    c = run_inputs.run_config(workdir, option)
  except (KeyError, TypeError, json.JSONDecodeError) as error:
    raise ValueError(f"{option}={str(workdir)!r} has a config.json that cannot be read "
                     f"({error})") from None
  if replica is not None and not 0 <= replica < c.num_replicas:
    raise ValueError(f"--replica must be in [0, {c.num_replicas}) for this run of {c.num_replicas} "
                     f"replicas, got {replica}")
  model_cfg = config_lib.model_config_of(c)
  abstract_model = nnx.eval_shape(lambda: llama.Decoder(model_cfg, nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  abstract_params = abstract_params.to_pure_dict()
  algorithm = algorithms.make_algorithm(c, c.num_replicas, abstract_params)
  mesh = mesh_lib.make_mesh(c.mesh.to_dict())
  # The run's own gradient source knows its state's layout (stacked replicas, or the pipeline grid).
  source = sources.make_source(c, graphdef, model_cfg, algorithm, mesh)
  param_specs = sharding.param_specs(llama.logical_axes(abstract_model), abstract_params,
                                     sharding.rules_for(c.sharding.layout), mesh)

  def init(params):
    params_r, opt_state = source.init(params)
    return TrainState(params_r, opt_state, jax.numpy.zeros((), jax.numpy.int32))

  abstract_state = jax.eval_shape(init, abstract_params)
  shardings = source.state_shardings(abstract_state, param_specs, abstract_params)
  template = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          abstract_state, shardings)
  restored = read_latest(workdir, template, option, c.data.tokenizer)
  if replica is not None:
    read = lambda state: jax.tree.map(lambda x: x[replica], source.replica_params(state.params))
    return model_cfg, jax.jit(read)(restored[1])
  evaluate = jax.jit(source.eval_params, out_shardings=sharding.named(mesh, param_specs))
  return model_cfg, evaluate(restored[1])


def read_eval_params(workdir, replica: int | None = None, option: str = "init_from") -> tuple:
  """(model config, evaluated parameters as host arrays) of the latest intact checkpoint of a run
  (`restore_eval_params`); every process must call it together."""
  model_cfg, params = restore_eval_params(workdir, replica, option)
  return model_cfg, distributed.fetch(params)


def provide_cpu_devices(workdir) -> None:
  """Before JAX starts its backends: as many CPU devices as the run's mesh fixes, so that a run
  trained on a mesh of N devices can be read back by a one-process tool on a CPU host (on GPU/TPU
  hosts the setting changes nothing). An explicit XLA_FLAGS device count is left as it is."""
  try:
    mesh = json.loads((pathlib.Path(workdir) / "config.json").read_text())["config"]["mesh"]
    needed = math.prod(max(int(n), 1) for n in mesh.values())
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return  # read_eval_params names what is wrong with the workdir
  if needed > 1 and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    try:
      jax.config.update("jax_num_cpu_devices", needed)
    except RuntimeError:
      # JAX already started: its devices stay; a mesh too large is refused, named
      pass


def read_model(workdir, replica: int | None = None) -> tuple:
  """(model config, parameters, tokenizer) of a run, for the tools that take its model out
  (`experiments/generate.py`, `export.py`, given the run as --workdir): `read_eval_params` and the
  run's tokenizer (its copy in the workdir, `run_inputs.run_config`). Called before anything else
  uses a device, it first provides the CPU devices the run's mesh needs (`provide_cpu_devices`)."""
  provide_cpu_devices(workdir)
  model_cfg, params = read_eval_params(workdir, replica, "--workdir")
  spec = run_inputs.run_config(workdir, "--workdir").data.get("tokenizer", "bytes")
  return model_cfg, params, tokenizer_lib.load_tokenizer(spec)
