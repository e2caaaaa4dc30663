"""`hetjax train --config run.yaml`: a run's flags as a YAML file, and back.

A config file holds the long flag names of `hetjax train` as keys, at the
top level or inside the sections that group them on `--help` (`modes:`,
`checkpoints:`), e.g.

  model: cnn
  global-batch: 96
  assignment: [16, 32, 48]     # a list is the flag's comma-separated value
  checkpoints:
    ckpt-dir: runs/cnn/ckpt
    ckpt-every: 50

Every key has one place: a flag grouped under a section on `--help` is
written in that section, every other flag at the top level; a key in
another place, or given twice, is refused, naming both places (YAML itself
would keep the last of two silently). The file becomes flags placed before
the command line's own, so flags given on the command line override it, and
every value meets the very checks (and error wordings) its flag meets,
before JAX starts. Every run writes its resolved configuration as
OUT/config.yaml, which `--config` reads back to run the same job again. No
JAX here: a bad file fails in a second.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NamedTuple

import yaml

CONFIG_FILE = "config.yaml"
# --help group title prefix -> section name in a config file
SECTIONS = {"modes": "modes", "checkpoints": "checkpoints"}
_NOT_IN_FILE = ("help", "config", "print_config")  # Flags about the file, not the run.


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
  """Key name (the long flag without '--') -> its action, for the run's flags."""
  out = {}
  for action in parser._actions:  # pylint: disable=protected-access
    longs = [o for o in action.option_strings if o.startswith("--")]
    if longs and action.dest not in _NOT_IN_FILE:
      out[longs[0][2:]] = action
  return out


def _section_of(parser: argparse.ArgumentParser) -> dict[str, str]:
  """Key name -> the section it is written under (absent: top level)."""
  out = {}
  for group in parser._action_groups:  # pylint: disable=protected-access
    section = next((s for prefix, s in SECTIONS.items()
                    if (group.title or "").startswith(prefix)), None)
    if section:
      for action in group._group_actions:  # pylint: disable=protected-access
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs:
          out[longs[0][2:]] = section
  return out


def _is_switch(action: argparse.Action) -> bool:
  return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))  # pylint: disable=protected-access


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
    if section in SECTIONS.values() and isinstance(value_node, yaml.MappingNode):
      for inner_key, inner_value in value_node.value:
        add(inner_key, inner_value, section)
    else:
      add(key_node, value_node, None)
  return entries


def _token(path: str, key: str, value: Any, action: argparse.Action) -> list[str]:
  """The flag tokens for one key; the value checked as its flag would be."""
  flag = next(o for o in action.option_strings if o.startswith("--"))
  if _is_switch(action):
    if not isinstance(value, bool):
      raise ValueError(f"config file {path}: {key} must be true or false, got {value!r}.")
    # `no-resume: true` gives the flag; so does `resume: false` (the dest's name).
    return [flag] if value else []
  if isinstance(value, (dict, bool)):
    raise ValueError(f"config file {path}: {key} must be a single value, got {value!r}.")
  if isinstance(value, (list, tuple)):
    value = ",".join(str(v) for v in value)
  text = str(value)
  if action.type is not None:
    try:
      converted = action.type(text)
    except (TypeError, ValueError):
      kind = getattr(action.type, "__name__", "value")
      raise ValueError(f"config file {path}: {key} must be {'an' if kind == 'int' else 'a'} "
                       f"{kind}, got {value!r} (the value of flag {flag}).") from None
  else:
    converted = text
  if action.choices is not None and converted not in action.choices:
    raise ValueError(f"config file {path}: {key} {value!r} is not one of "
                     f"{', '.join(map(str, action.choices))}.")
  return [f"{flag}={text}"]


def to_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
  """The flags a config file stands for, to place before the command line's own.

  Raises:
    ValueError: an unreadable file, an unknown key (with the nearest
      name), a key in another section or given twice (naming both places),
      or a value its flag would refuse.
  """
  try:
    with open(path) as f:
      entries = _entries(path, f.read())
  except OSError as e:
    raise ValueError(f"cannot read config file {path}: {e.strerror or e}.") from None
  except yaml.YAMLError as e:
    raise ValueError(f"config file {path} is not valid YAML: {e}") from None
  actions, sections = _actions(parser), _section_of(parser)
  by_dest = {a.dest.replace("_", "-"): (k, a) for k, a in actions.items() if _is_switch(a)}
  argv: list[str] = []
  for key, value, section, line in entries:
    name, action = by_dest[key] if key not in actions and key in by_dest else (key, None)
    if name not in actions:
      near = difflib.get_close_matches(key, list(actions) + list(by_dest), n=1)
      raise ValueError(f"config file {path}: unknown key {key!r}"
                       + (f" (did you mean {near[0]!r}?)" if near else "")
                       + "; keys are the long flag names of `hetjax train --help`.")
    if sections.get(name) != section:
      raise ValueError(f"config file {path}, line {line}: `{key}` belongs "
                       f"{_where(sections.get(name))}, found {_where(section)}.")
    if value is None:
      continue  # null: the flag's default.
    if action is not None:  # `resume: false` for --no-resume.
      if not isinstance(value, bool):
        raise ValueError(f"config file {path}: {key} must be true or false, got {value!r}.")
      argv += _token(path, name, not value if isinstance(action, argparse._StoreFalseAction)  # pylint: disable=protected-access
                     else value, action)
      continue
    argv += _token(path, key, value, actions[key])
  return argv


def resolved(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
  """Every flag's final value, under the keys and sections a config file uses.

  Switches are written under the dest's name (`resume: true`), which reads
  better than `no-resume: false` and reads back the same.
  """
  sections = _section_of(parser)
  out: dict[str, Any] = {}
  for key, action in _actions(parser).items():
    name = action.dest.replace("_", "-") if _is_switch(action) else key
    value = getattr(args, action.dest, None)
    where = out.setdefault(sections[key], {}) if key in sections else out
    where[name] = value
  return out


def dump(config: dict[str, Any], head: bool = False) -> str:
  """The YAML text of a resolved config; `head`: a comment saying how to re-run it."""
  head_text = ("# The resolved flags of a hetjax run; `hetjax train --config THIS_FILE` runs it "
               "again\n# (flags after --config override these, e.g. --out runs/again).\n"
               if head else "")
  return head_text + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
