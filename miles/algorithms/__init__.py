"""What each algorithm is (ARCHITECTURE §12): the declaration record, the registry (built-ins and the ones
`--algorithm-path` plugins register), and the run's roles. `algorithm_of(args)` is the record of the run."""

from __future__ import annotations

from miles.algorithms.base import (
    ACTOR,
    OLD_POLICY,
    ROLE_OVERRIDES,
    TEACHER,
    Algorithm,
    Computed,
    FirstWindowMetrics,
    FrozenNetwork,
    Role,
    reference_rule,
    role_dest,
    role_flag,
    stochastic_steps_rule,
)
from miles.algorithms.registry import (
    ALGORITHMS,
    BUILTIN_ALGORITHMS,
    DEFAULT_LOSS_TYPE,
    algorithm_of,
    get_algorithm,
    register_algorithm,
)
from miles.algorithms.roles import role_settings, trained_roles, training_order

__all__ = [
    "ACTOR",
    "ALGORITHMS",
    "BUILTIN_ALGORITHMS",
    "DEFAULT_LOSS_TYPE",
    "OLD_POLICY",
    "ROLE_OVERRIDES",
    "TEACHER",
    "Algorithm",
    "Computed",
    "FirstWindowMetrics",
    "FrozenNetwork",
    "Role",
    "algorithm_of",
    "get_algorithm",
    "reference_rule",
    "register_algorithm",
    "role_dest",
    "role_flag",
    "role_settings",
    "stochastic_steps_rule",
    "trained_roles",
    "training_order",
]
