"""`hetjax train --config run.yaml`: a run's settings as a YAML file, and back.

A config file holds `hetjax train`'s keys (`hetjax.cli.flags.FIELDS`: the
long flag names, and the expert's keys that have no flag) at the top level
or inside the sections that group them (`modes:`, `checkpoints:`), e.g.

  model: cnn
  global-batch: 96
  assignment: [16, 32, 48]     # a list is the flag's comma-separated value
  reduction: host              # no flag: the platform decides unless a file says
  checkpoints:
    ckpt-dir: runs/cnn/ckpt
    ckpt-every: 50

A key elsewhere, or given twice, is refused naming both places (YAML would
keep the last silently). The file's values, checked as flags are, become the
flags' defaults, so flags override them.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NamedTuple

import yaml

from hetjax.cli import flags

CONFIG_FILE = "config.yaml"
SECTIONS = ("modes", "checkpoints")
# A switch's former flag name as a key (`no-resume: true`): its key, negated.
_NEGATED = {"no-resume": "resume", "sync-save": "async-save"}


class _Entry(NamedTuple):
  """One key of a config file, where it was found."""

  key: str
  value: Any
  section: str | None  # None: the top level
  line: int


def _where(section: str | None) -> str:
  return "at the top level" if section is None else f"in section `{section}`"


def _entries(path: str, text: str) -> list[_Entry]:
  """The file's keys in order, sections opened; a key given twice is refused with both lines."""
  loader = yaml.SafeLoader(text)
  try:
    root = loader.get_single_node()
  finally:
    loader.dispose()
  if root is None:
    return []
  value = lambda node: yaml.SafeLoader("").construct_document(node)
  if not isinstance(root, yaml.MappingNode):
    raise ValueError(f"config file {path} must hold a mapping of flag names to values, e.g. "
                     f"'global-batch: 64', not a {type(value(root)).__name__}.")
  entries: list[_Entry] = []

  def add(key_node: yaml.Node, value_node: yaml.Node, section: str | None) -> None:
    key = str(value(key_node)).replace("_", "-")
    entry = _Entry(key, value(value_node), section, key_node.start_mark.line + 1)
    first = next((e for e in entries if e.key == key), None)
    if first is not None:
      places = [f"line {e.line}" + ("" if e.section is None else f" (section `{e.section}`)")
                for e in (first, entry)]
      raise ValueError(f"config file {path}: `{key}` given twice: {places[0]} and {places[1]}; "
                       "keep one.")
    entries.append(entry)

  for key_node, value_node in root.value:
    section = str(value(key_node))
    if section in SECTIONS and isinstance(value_node, yaml.MappingNode):
      for inner_key, inner_value in value_node.value:
        add(inner_key, inner_value, section)
    else:
      add(key_node, value_node, None)
  return entries


def _value(path: str, field: flags.Field, value: Any) -> Any:
  """One key's value, converted and checked as its flag's would be."""
  if field.kind is bool:
    if not isinstance(value, bool):
      raise ValueError(f"config file {path}: {field.key} must be true or false, got {value!r}.")
    return value
  if isinstance(value, bool) and field.name == "shard_within_host":
    value = "on" if value else "off"  # YAML 1.1 reads a bare on / off as a boolean.
  if isinstance(value, (dict, bool)):
    raise ValueError(f"config file {path}: {field.key} must be a single value, got {value!r}.")
  text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
  try:
    converted = field.kind(text)
  except (TypeError, ValueError):
    kind = field.kind.__name__
    raise ValueError(f"config file {path}: {field.key} must be {'an' if kind == 'int' else 'a'} "
                     f"{kind}, got {value!r}" + (f" (the value of flag {field.flag})."
                                                  if field.group else ".")) from None
  choices = flags.CHOICES.get(field.name)
  if choices is not None and converted not in choices:
    raise ValueError(f"config file {path}: {field.key} {value!r} is not one of "
                     f"{', '.join(choices)}.")
  return converted


def read(path: str) -> dict[str, Any]:
  """The settings of a config file, by their attribute on the parsed arguments; raises
  ValueError for an unreadable file, an unknown, misplaced or repeated key, or a bad value."""
  try:
    with open(path) as f:
      entries = _entries(path, f.read())
  except OSError as e:
    raise ValueError(f"cannot read config file {path}: {e.strerror or e}.") from None
  except yaml.YAMLError as e:
    raise ValueError(f"config file {path} is not valid YAML: {e}") from None
  values: dict[str, Any] = {}
  for key, value, section, line in entries:
    field = flags.BY_KEY.get(_NEGATED.get(key, key))
    if field is None:
      near = difflib.get_close_matches(key, list(flags.BY_KEY), n=1)
      raise ValueError(f"config file {path}: unknown key {key!r}"
                       + (f" (did you mean {near[0]!r}?)" if near else "")
                       + "; keys are the long flag names of `hetjax train --help`, and the keys "
                       "without a flag in docs/cli.md.")
    if field.section != section:
      raise ValueError(f"config file {path}, line {line}: `{key}` belongs "
                       f"{_where(field.section)}, found {_where(section)}.")
    if value is not None:  # null: the default.
      value = _value(path, field, value)
      values[field.dest] = (not value) if key in _NEGATED else value
  return values


def resolved(args: argparse.Namespace) -> dict[str, Any]:
  """Every setting's final value, under the keys and sections a config file uses."""
  out: dict[str, Any] = {}
  for field in flags.FIELDS:
    where = out.setdefault(field.section, {}) if field.section else out
    where[field.key] = getattr(args, field.dest)
  return out


def dump(config: dict[str, Any], head: bool = False) -> str:
  """The YAML text of a resolved config; `head`: a comment saying how to re-run it."""
  head_text = ("# The resolved flags of a hetjax run; `hetjax train --config THIS_FILE` runs it "
               "again\n# (flags after --config override these, e.g. --out runs/again).\n"
               if head else "")
  return head_text + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
