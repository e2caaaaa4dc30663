"""The `hetjax` command (`hetjax train | report | doctor`), JAX-free until a job runs.

`flags` defines every command's flags and rewords config errors as flags
(one place), `mode_flags` turns `--mode` and its settings into a
`RoundsConfig`, `config_file` reads and writes `--config` YAML (every key in
one place), `user_code` loads `--model` / `--dataset` factories, and
`commands` checks it all before JAX loads, then runs the Trainer. Here the
configuration starts its one-way trip: CLI -> config -> Trainer -> mode.
"""

from hetjax.cli.commands import main, parse_args, resolved_config

__all__ = ["main", "parse_args", "resolved_config"]
