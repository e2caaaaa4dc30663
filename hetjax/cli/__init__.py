"""The `hetjax` command (`hetjax train | report | doctor`), JAX-free until a job runs.

`commands` parses and checks the flags, `config_file` reads and writes
`--config` YAML, `user_code` loads `--model` / `--dataset` factories.
"""

from hetjax.cli.commands import main, parse_args, resolved_config

__all__ = ["main", "parse_args", "resolved_config"]
