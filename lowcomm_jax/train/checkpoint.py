"""Orbax checkpoints of the train state and the data iterator's state, and the workdir's config guard."""

from __future__ import annotations

import json
import pathlib

import jax
import orbax.checkpoint as ocp

from lowcomm_jax import distributed

_HANDLER_REGISTERED = False


def _fast_array_handler() -> None:
  # Replica-parallel writes make the first save take 4-26 s on CPU; one writer is enough here.
  global _HANDLER_REGISTERED
  if not _HANDLER_REGISTERED:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
    _HANDLER_REGISTERED = True


class Checkpointer:
  """Saves every `every` steps under workdir/checkpoints; restores the latest complete one.

  A save is written to a temporary directory and renamed when every process has finished it, so a
  run killed mid-save leaves no step directory (its leftovers are removed at the next start). A
  step directory damaged afterwards (files truncated or deleted) fails to restore; it is moved to
  workdir/checkpoints_unreadable/ with a log line and the previous one is restored instead.
  """

  def __init__(self, workdir: pathlib.Path, keep: int):
    _fast_array_handler()
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    self.unreadable = self.directory.parent / "checkpoints_unreadable"
    self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))

  def restore(self, step: int, abstract_state):
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
    self.manager.close()


def check_workdir(workdir: pathlib.Path, fingerprint: dict, defaults: dict | None = None) -> bool:
  """Raises if `workdir` holds a run of another config; returns whether it holds a run at all.

  A key the saved run does not know (added to the config since) counts as its default value.
  Reads only: an existing run directory is never changed by a refused start.
  """
  saved = pathlib.Path(workdir) / "config.json"
  if not saved.exists():
    return False
  previous = json.loads(saved.read_text())["fingerprint"]
  current = json.loads(json.dumps(fingerprint, default=str))
  for key, value in json.loads(json.dumps(defaults or {}, default=str)).items():
    previous.setdefault(key, value)
  differing = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
  if differing:
    details = ", ".join(f"{k}: {previous.get(k)!r} -> {current.get(k)!r}" for k in differing[:8])
    raise ValueError(f"workdir {workdir} holds a run of another config ({details}); "
                     "use a new --workdir or the same config to resume")
  return True
