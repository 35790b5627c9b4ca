"""Orbax checkpoints of the train state and the data iterator's state, and the workdir's config guard."""

from __future__ import annotations

import json
import pathlib

import orbax.checkpoint as ocp

_HANDLER_REGISTERED = False


def _fast_array_handler() -> None:
  # Replica-parallel writes make the first save take 4-26 s on CPU; one writer is enough here.
  global _HANDLER_REGISTERED
  if not _HANDLER_REGISTERED:
    import jax  # pylint: disable=g-import-not-at-top
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
    _HANDLER_REGISTERED = True


class Checkpointer:
  """Saves every `every` steps under workdir/checkpoints; restores the latest complete one."""

  def __init__(self, workdir: pathlib.Path, keep: int):
    _fast_array_handler()
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))

  def restore(self, step: int, abstract_state):
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return restored["state"], restored["data"]

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
