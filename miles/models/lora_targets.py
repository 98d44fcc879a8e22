"""Which of a LoRA config's target modules a network lacks: peft binds the targets it finds and silently skips the
others (it fails only when none match), so an adapter can train and sync while modifying less than was asked."""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn


def missing_lora_targets(network: nn.Module, target_modules: str | Sequence[str]) -> list[str]:
    """The targets no module name of `network` matches, by peft's rule: a listed name matches a module named
    exactly so or ending in `.name`; a string is a regular expression over the whole module name."""
    names = [name for name, _ in network.named_modules() if name]
    if isinstance(target_modules, str):
        return [] if any(re.fullmatch(target_modules, name) for name in names) else [target_modules]
    return [t for t in target_modules if not any(name == t or name.endswith(f".{t}") for name in names)]


def check_lora_targets(network: nn.Module, target_modules: str | Sequence[str], where: str) -> None:
    """Raise naming the targets `network` lacks (`where`: whose network, e.g. "the rollout engine's transformer")."""
    missing = missing_lora_targets(network, target_modules)
    if missing:
        raise ValueError(
            f"--lora-target-modules {missing} match no module of {where} ({type(network).__name__}); peft would bind "
            "the adapter to the other targets only and train the rest as if it were there. Name modules that exist "
            "(e.g. to_q,to_k,to_v,to_out.0) or drop those"
        )
