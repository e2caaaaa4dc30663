"""How the global batch is split between hosts. Pure numpy, no JAX.

Every host computes the assignment itself from values every host holds
(docs/design.md invariant 3), so an assignment policy must be deterministic.
One file per job:

- `split`: the splits that need no profiling (`equal`, a given one) and the
  checks every split passes;
- `ladder`: how a host runs a share (device rounds, micro-batches of `k`
  blocks per device and the smaller programs of its ladder), and what that
  costs in work units;
- `cost`: the per-host cost model, fitted online and robustly;
- `solver`: the exact integer min-max split for that cost;
- `profiling`: the `static` / `dynamic` balancer around cost model and solver;
- `policies`: the `Balancer` protocol, the fixed policies and `make_balancer`.

Every public name is re-exported here, so `from hetjax import balancer` and
`balancer.X` are the whole interface.
"""

from hetjax.balancer.cost import CostModel, CostParams
from hetjax.balancer.ladder import Ladder, Ladders, as_ladders, halving, padded
from hetjax.balancer.policies import (MODES, Balancer, FixedBalancer,
                                      make_balancer, taus_from_speeds)
from hetjax.balancer.profiling import ProfilingBalancer
from hetjax.balancer.solver import solve
from hetjax.balancer.split import (equal_split, parse_assignment,
                                   validate_shares)

__all__ = ["MODES", "Balancer", "CostModel", "CostParams", "FixedBalancer", "Ladder", "Ladders",
           "ProfilingBalancer", "as_ladders", "equal_split", "halving", "make_balancer", "padded", "parse_assignment", "solve",
           "taus_from_speeds", "validate_shares"]
