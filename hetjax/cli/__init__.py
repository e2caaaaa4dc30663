"""The `hetjax` command (`hetjax train | report | doctor`), JAX-free until a job runs.

`flags` generates `train`'s flags and config keys from the configs' fields
and rewords config errors as flags (one table), `config_file` reads and
writes `--config` YAML (every key in one place), `user_code` loads
`--model` / `--dataset` factories, and `commands` checks it all before JAX loads, then runs the Trainer. Here the
configuration starts its one-way trip: CLI -> config -> Trainer -> mode.
"""

from hetjax.cli.commands import main, parse_args, resolved_config

__all__ = ["main", "parse_args", "resolved_config"]
