"""Orbax checkpoints of the train state and the data iterator's state, each sealed by a checksum."""

from __future__ import annotations

import hashlib
import json
import pathlib
import threading

import jax
import orbax.checkpoint as ocp

from lowcomm_jax import distributed

_HANDLER_REGISTERED = False
# Written last into a step directory: the SHA-256 of every other file of the step.
CHECKSUM_FILE = "lowcomm_sha256.json"


def _fast_array_handler() -> None:
  # Replica-parallel writes make the first save take 4-26 s on CPU; one writer is enough here.
  global _HANDLER_REGISTERED
  if not _HANDLER_REGISTERED:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
    _HANDLER_REGISTERED = True


class DamagedCheckpoint(ValueError):
  """A step directory whose files are not the ones its save wrote."""


def file_digests(step_dir: pathlib.Path) -> dict[str, str]:
  """SHA-256 of every file under `step_dir` (but the checksum file), by relative path."""
  digests = {}
  for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
    name = str(path.relative_to(step_dir))
    if name != CHECKSUM_FILE:
      sha = hashlib.sha256()
      with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
          sha.update(block)
      digests[name] = sha.hexdigest()
  return digests


def seal(step_dir: pathlib.Path) -> None:
  """Writes the checksum file of a finished step (atomically: a torn write is no checksum)."""
  tmp = step_dir / (CHECKSUM_FILE + ".tmp")
  tmp.write_text(json.dumps({"sha256": file_digests(step_dir)}, indent=1))
  tmp.rename(step_dir / CHECKSUM_FILE)


def verify(step_dir: pathlib.Path) -> None:
  """Raises DamagedCheckpoint naming the first file that is missing, added or changed."""
  try:
    expected = json.loads((step_dir / CHECKSUM_FILE).read_text())["sha256"]
  except FileNotFoundError:
    raise DamagedCheckpoint(f"{CHECKSUM_FILE} is missing: the save never finished, or the step "
                            "was copied without it") from None
  except (ValueError, KeyError, TypeError) as error:
    raise DamagedCheckpoint(f"{CHECKSUM_FILE} is unreadable ({error})") from None
  actual = file_digests(step_dir)
  for name in sorted(set(expected) | set(actual)):
    if name not in actual:
      raise DamagedCheckpoint(f"file {name} is missing")
    if name not in expected:
      raise DamagedCheckpoint(f"file {name} was not written by the save")
    if actual[name] != expected[name]:
      raise DamagedCheckpoint(f"file {name} differs from its SHA-256 at save time")


class Checkpointer:
  """Saves every `every` steps under workdir/checkpoints; restores the latest intact one.

  A save is written to a temporary directory and renamed when every process has finished it, so a
  run killed mid-save leaves no step directory (its leftovers are removed at the next start). Once
  renamed, process 0 seals it with the SHA-256 of each of its files (CHECKSUM_FILE, written last, by
  a thread, so saves stay asynchronous). A restore verifies every
  file first: a step damaged afterwards (a flipped bit, a truncated or deleted file, edited JSON
  of the data iterator) or never sealed is moved to workdir/checkpoints_unreadable/ with a log line
  naming it and the file, and the previous one is restored instead.
  """

  def __init__(self, workdir: pathlib.Path, keep: int):
    _fast_array_handler()
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    self.unreadable = self.directory.parent / "checkpoints_unreadable"
    self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True))
    self._sealer = None  # process 0's thread that seals the step whose save is in flight

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict) -> None:
    self._join_sealer()
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))
    if distributed.is_primary():  # orbax renames the step once every process has written its part
      self._sealer = threading.Thread(target=self._seal_when_written, args=(step,), daemon=True,
                                      name=f"seal checkpoint {step}")
      self._sealer.start()

  def _seal_when_written(self, step: int) -> None:
    try:
      self.manager.wait_until_finished()
      if (self.directory / str(step)).is_dir():
        seal(self.directory / str(step))
    except Exception as error:  # pylint: disable=broad-except
      print(f"warning: checkpoint step {step} could not be sealed ({type(error).__name__}: "
            f"{error}); it will be set aside at the next start", flush=True)

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
    """(step, state, data) of the newest checkpoint every process can read; None if there is none."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        restored, reason = self.restore(step, abstract_state), ""
      except Exception as error:  # pylint: disable=broad-except
        # orbax and tensorstore raise many kinds of error for missing or truncated files
        restored, reason = None, f"{type(error).__name__}: {(str(error) or '?').splitlines()[0][:200]}"
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
    self.manager.wait_until_finished()
    self._join_sealer()
    distributed.barrier("checkpoints sealed")  # no process ends before the last step is sealed
    self.manager.close()


def restore_eval_params(workdir, replica: int | None = None, option: str = "init_from") -> tuple:
  """(model config, evaluated parameters) of the latest intact checkpoint of a run, as sharded
  global arrays.

  The evaluated parameters are what the run evaluates: replica 0's (DiLoCo after its last outer
  step: all replicas equal), the global φ, or NoLoCo's mean slow weights (`eval_params`); with
  `replica`, that replica's own current parameters θ_i instead. Reads the run's config.json and
  checkpoints only, and writes nothing. The train state is restored laid out as that run laid it
  out (its mesh over this job's devices, its sharding layout), so no device holds more of it than
  the run's own devices did, and the parameters come out sharded by the run's layout. `option`
  names the flag or key that gave `workdir` in the errors.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from lowcomm_jax import config as config_lib, mesh as mesh_lib, sharding  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.models import llama  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.train import algorithms, sources, step as step_lib  # pylint: disable=g-import-not-at-top
  workdir = pathlib.Path(workdir)
  if not (workdir / "config.json").is_file() or not (workdir / "checkpoints").is_dir():
    raise ValueError(f"{option}={str(workdir)!r} holds no config.json and checkpoints/ of a run")
  try:
    c = config_lib.load_run_config(workdir)
  except (ValueError, KeyError, TypeError) as error:
    raise ValueError(f"{option}={str(workdir)!r} has a config.json that cannot be read ({error})") from None
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
    return step_lib.TrainState(params_r, opt_state, jax.numpy.zeros((), jax.numpy.int32))

  abstract_state = jax.eval_shape(init, abstract_params)
  shardings = source.state_shardings(abstract_state, param_specs, abstract_params)
  template = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          abstract_state, shardings)
  ckpt = Checkpointer(workdir, c.checkpoint.keep)
  restored = ckpt.restore_latest(template)
  ckpt.close()
  if restored is None:
    raise ValueError(f"{option}={str(workdir)!r} has no intact checkpoint to read")
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
  import math  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  try:
    mesh = json.loads((pathlib.Path(workdir) / "config.json").read_text())["config"]["mesh"]
    needed = math.prod(max(int(n), 1) for n in mesh.values())
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return  # read_eval_params names what is wrong with the workdir
  if needed > 1 and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    try:
      jax.config.update("jax_num_cpu_devices", needed)
    except RuntimeError:  # JAX already started: its devices stay; a mesh too large is refused, named
      pass


def read_model(workdir, replica: int | None = None) -> tuple:
  """(model config, parameters, tokenizer) of a run, for the tools that take its model out
  (`experiments/generate.py`, `export.py`, given the run as --workdir): `read_eval_params` and the
  run's `data.tokenizer`. Called before anything else uses a device, it first provides the CPU
  devices the run's mesh needs (`provide_cpu_devices`)."""
  provide_cpu_devices(workdir)
  from lowcomm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from lowcomm_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  model_cfg, params = read_eval_params(workdir, replica, "--workdir")
  spec = config_lib.load_run_config(workdir).data.get("tokenizer", "bytes")
  return model_cfg, params, tokenizer_lib.load_tokenizer(spec)
