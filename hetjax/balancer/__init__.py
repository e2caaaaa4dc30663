"""How the global batch is split between hosts. Pure numpy, no JAX.

Every host computes the assignment itself from values every host holds
(invariant 3), so a policy must be deterministic. `split`: splits that need no
profiling and their checks; `ladder`: how a host runs a share and its work;
`cost`: the online cost model; `solver`: the exact integer min-max split;
`profiling`: `static` / `dynamic`; `policies`: the protocol and `make_balancer`.
Every public name is re-exported here.
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
