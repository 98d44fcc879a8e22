"""Every algorithm runs on its defaults alone (`--loss-type X`, the shipped model and prompts): parse, every rule,
the computed defaults and the start-up checks pass, and what the algorithm chose is said in words; where nothing can be chosen for the
user (custom_loss's hooks) one line names what to add."""

from __future__ import annotations

import os
import sys

import pytest

from miles.algorithms import ALGORITHMS, BUILTIN_ALGORITHMS
from miles.arguments.parser import parse_args
from miles.startup import startup_checks
from tests.fast.arguments.test_parser import parse_error

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


def test_custom_loss_names_the_hooks_to_add_in_one_line(capsys):
    err = parse_error(["--loss-type", "custom_loss"], capsys).strip().splitlines()[-1]
    assert err.endswith(
        "error: --loss-type custom_loss runs your hooks: add --custom-prepare-train-batch-path and "
        "--custom-loss-function-path (pkg.mod.fn or file.py:fn; docs/user-guide/customization.md)"
    )


def test_awm_without_a_reference_drops_the_kl_to_it_and_says_so():
    """The issue's case: `--loss-type awm` stopped on its own --awm-kl-beta 0.001 without --ref-mode."""
    args = parse_args(["--loss-type", "awm", "--num-rollout", "2"])
    assert args.awm_kl_beta == 0.0 and args.awm_ema_kl_beta == 1.0
    (note,) = args.default_notes
    assert note.startswith("--loss-type awm: no --ref-mode reference, so --awm-kl-beta is 0")
    assert "--use-lora --ref-mode lora_base" in note  # the authors' reference, named


def test_awm_with_a_reference_takes_the_authors_kl_weight():
    args = parse_args(["--loss-type", "awm", "--use-lora", "--ref-mode", "lora_base"])
    assert args.awm_kl_beta == 1e-3 and "the authors'" in args.default_notes[0]
    assert (
        parse_args(["--loss-type", "awm", "--awm-kl-beta", "0.01", "--use-ema", "--ref-mode", "ema"]).default_notes
        == ()
    )


def test_awm_given_a_kl_weight_without_a_reference_is_still_refused(capsys):
    err = parse_error(["--loss-type", "awm", "--awm-kl-beta", "0.001"], capsys)
    assert "--awm-kl-beta 0.001 needs the frozen reference v_ref: --ref-mode" in err
