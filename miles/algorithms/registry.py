"""The algorithm registry: every built-in declaration, the ones `--algorithm-path` plugins register, and the lookup
the rest of miles asks (`algorithm_of(args)`)."""

from __future__ import annotations

import argparse

from miles.algorithms import (
    awm,
    custom,
    direct_align,
    dmd2,
    dpo,
    draft,
    flow_dppo,
    flow_grpo,
    grpo_guard,
    nft,
    refl,
    sft,
)
from miles.algorithms.base import Algorithm

BUILTIN_ALGORITHMS: tuple[Algorithm, ...] = (
    sft.ALGORITHM,
    grpo_guard.ALGORITHM,  # before policy_loss: the plot recognises a run by the first record whose metrics it logged
    flow_dppo.ALGORITHM,
    flow_grpo.ALGORITHM,
    nft.ALGORITHM,
    dmd2.ALGORITHM,
    dpo.ALGORITHM,
    awm.ALGORITHM,
    refl.ALGORITHM,
    draft.ALGORITHM,
    direct_align.ALGORITHM,
    custom.ALGORITHM,
)
ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in BUILTIN_ALGORITHMS}
DEFAULT_LOSS_TYPE = nft.ALGORITHM.name  # a run with no flags: DiffusionNFT on the shipped shapes model


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Add a plugin's declaration (from its --algorithm-path module); a name taken by another record is an error."""
    existing = ALGORITHMS.get(algorithm.name)
    if existing is not None and existing is not algorithm:
        raise ValueError(f"algorithm {algorithm.name!r} is registered already")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(
            f"--loss-type {name!r} is unknown: choose one of {', '.join(ALGORITHMS)}, or declare it in a module "
            "given with --algorithm-path (docs/user-guide/customization.md)"
        )
    return ALGORITHMS[name]


def algorithm_of(args: argparse.Namespace) -> Algorithm:
    """The declaration of the run's --loss-type."""
    return get_algorithm(args.loss_type)
