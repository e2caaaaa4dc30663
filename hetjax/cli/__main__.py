"""`python -m hetjax.cli ...`: the `hetjax` command, as the launchers run it on each host."""

import sys

from hetjax.cli import main

sys.exit(main())
