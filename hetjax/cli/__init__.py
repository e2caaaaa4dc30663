"""The `hetjax` command (`hetjax train | report | doctor`), JAX-free until a job runs.

Here the configuration starts its one-way trip: CLI -> config -> Trainer -> mode.
"""

from hetjax.cli.commands import main, parse_args, resolved_config

__all__ = ["main", "parse_args", "resolved_config"]
