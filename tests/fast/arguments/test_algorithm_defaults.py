"""Every algorithm runs on its defaults alone (`--loss-type X`, the shipped model and prompts): parse, every rule,
the computed defaults and the start-up checks pass. What awm chose is said in words (tests/fast/algorithms/test_awm.py);
custom_loss, where nothing can be chosen for the user, names its hooks in one line
(tests/fast/algorithms/test_custom.py)."""

from __future__ import annotations

import os
import sys

import pytest

from miles.algorithms import ALGORITHMS, BUILTIN_ALGORITHMS
from miles.arguments.parser import parse_args
from miles.startup import startup_checks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PLUGINS = {"awfm": "advantage_weighted_fm.py", "cffm": "critic_filtered_fm.py"}  # examples/ declaring algorithms
NEEDS_THE_USER = {"custom_loss"}  # its hooks are the user's code: no default can be right


@pytest.mark.parametrize("loss", [a.name for a in BUILTIN_ALGORITHMS if a.name not in NEEDS_THE_USER])
def test_every_built_in_loss_type_runs_on_its_defaults(loss):
    """Parse, rules, computed defaults, then every start-up check (the family, the hooks, the prompt files)."""
    args = parse_args(["--loss-type", loss])
    assert args.loss_type == loss and args.hf_checkpoint == "builtin:tiny-shapes"
    startup_checks(args)


@pytest.fixture
def fresh_registry():
    """What a test's plugin registers is forgotten afterwards, module included (a later load registers it again)."""
    algorithms, modules = dict(ALGORITHMS), set(sys.modules)
    yield
    ALGORITHMS.clear()
    ALGORITHMS.update(algorithms)
    for name in set(sys.modules) - modules:
        if name.startswith("miles_user_module_"):
            del sys.modules[name]


@pytest.mark.parametrize("loss", sorted(PLUGINS))
def test_the_examples_algorithms_run_on_their_defaults(loss, fresh_registry):
    plugin = os.path.join(ROOT, "examples", PLUGINS[loss])
    assert parse_args(["--algorithm-path", plugin, "--loss-type", loss]).loss_type == loss
