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

The file becomes flags placed before the command line's own, so flags given
on the command line override it, and every value meets the very checks (and
error wordings) its flag meets, before JAX starts. Every run writes its
resolved configuration as OUT/config.yaml, which `--config` reads back to
run the same job again. No JAX here: a bad file fails in a second.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any

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


def _flatten(path: str, tree: Any) -> list[tuple[str, Any]]:
  if tree is None:
    return []
  if not isinstance(tree, dict):
    raise ValueError(f"config file {path} must hold a mapping of flag names to values, e.g. "
                     f"'global-batch: 64', not a {type(tree).__name__}.")
  items = []
  for key, value in tree.items():
    if str(key) in SECTIONS.values() and isinstance(value, dict):
      items += [(str(k), v) for k, v in value.items()]
    else:
      items.append((str(key), value))
  return items


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
      name), or a value its flag would refuse.
  """
  try:
    with open(path) as f:
      tree = yaml.safe_load(f)
  except OSError as e:
    raise ValueError(f"cannot read config file {path}: {e.strerror or e}.") from None
  except yaml.YAMLError as e:
    raise ValueError(f"config file {path} is not valid YAML: {e}") from None
  actions = _actions(parser)
  by_dest = {a.dest.replace("_", "-"): (k, a) for k, a in actions.items() if _is_switch(a)}
  argv: list[str] = []
  for key, value in _flatten(path, tree):
    key = key.replace("_", "-")
    if value is None:
      continue  # null: the flag's default.
    if key not in actions and key in by_dest:  # `resume: false` for --no-resume.
      name, action = by_dest[key]
      if not isinstance(value, bool):
        raise ValueError(f"config file {path}: {key} must be true or false, got {value!r}.")
      argv += _token(path, name, not value if isinstance(action, argparse._StoreFalseAction)  # pylint: disable=protected-access
                     else value, action)
      continue
    if key not in actions:
      near = difflib.get_close_matches(key, list(actions) + list(by_dest), n=1)
      raise ValueError(f"config file {path}: unknown key {key!r}"
                       + (f" (did you mean {near[0]!r}?)" if near else "")
                       + "; keys are the long flag names of `hetjax train --help`.")
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
