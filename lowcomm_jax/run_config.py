"""The run configuration parsed: one frozen dataclass per section, held by a frozen `RunConfig`.

`lowcomm_jax.train.validation.validate` checks a `ml_collections.ConfigDict` once and returns its
`RunConfig`; the Trainer and the elastic driver take that, so nothing is checked twice and nothing
changes a run's configuration once it is checked (assigning to a field raises
`dataclasses.FrozenInstanceError`; `dataclasses.replace` makes a changed copy).

The classes are made from `lowcomm_jax.config.default_config()`, which stays the one place where
each key, its default and its allowed values are written: `RunConfig.outer` is an `OuterConfig`
whose fields are the `outer` section's keys, typed as their defaults. A section reads as the
ConfigDict did (`run.outer.sync_every`, `run.mesh.to_dict()`, `run.outer["codec"]`), so code
that reads a config takes either.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from lowcomm_jax import config as config_lib


class _Fields:
  """What a section and the whole configuration read like besides their attributes."""

  def __getitem__(self, key: str):
    return getattr(self, key)

  def __contains__(self, key: str) -> bool:
    return key in self.__dataclass_fields__  # pylint: disable=no-member

  def items(self):
    return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

  def to_dict(self) -> dict:
    """The nested {key: value} of plain values (as `ConfigDict.to_dict`), e.g. for config.json."""
    return {k: v.to_dict() if isinstance(v, _Fields) else v for k, v in self.items()}


def _class_name(section: str) -> str:
  return "".join(part.capitalize() for part in section.split("_")) + "Config"


_HERE = {"__module__": __name__}  # where the classes say they were defined (pickle finds them)


def _make_classes():
  defaults = config_lib.default_config()
  sections, top = {}, []
  for key, value in defaults.items():
    if isinstance(value, ml_collections.ConfigDict):
      fields = [(k, type(v)) for k, v in value.items()]
      sections[key] = dataclasses.make_dataclass(_class_name(key), fields, bases=(_Fields,),
                                                 frozen=True, namespace=_HERE)
      top.append((key, sections[key]))
    else:
      top.append((key, type(value)))
  run = dataclasses.make_dataclass("RunConfig", top, bases=(_Fields,), frozen=True,
                                   namespace=_HERE)
  return run, sections


RunConfig, SECTIONS = _make_classes()
RunConfig.__doc__ = ("A checked run configuration: `default_config()`'s keys, each section a "
                     "frozen dataclass (SECTIONS).")
globals().update({cls.__name__: cls for cls in SECTIONS.values()})  # OuterConfig, DataConfig, ...
OuterConfig = SECTIONS["outer"]


def parse(c: ml_collections.ConfigDict) -> RunConfig:
  """The RunConfig holding `c`'s values as they are (no check: `validation.validate` checks first
  and is what callers use)."""
  values = {}
  for key in RunConfig.__dataclass_fields__:
    if key in SECTIONS:
      values[key] = SECTIONS[key](**{k: c[key][k] for k in SECTIONS[key].__dataclass_fields__})
    else:
      values[key] = c[key]
  return RunConfig(**values)


def replace(run: RunConfig, changes: dict) -> RunConfig:
  """A copy of `run` with dotted keys changed ({"mesh.replica": 1, "num_replicas": 4})."""
  top, sections = {}, {}
  for key, value in changes.items():
    section, _, name = key.rpartition(".")
    if section:
      sections.setdefault(section, {})[name] = value
    else:
      top[key] = value
  for section, values in sections.items():
    top[section] = dataclasses.replace(run[section], **values)
  return dataclasses.replace(run, **top)
