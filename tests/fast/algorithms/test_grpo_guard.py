"""The grpo_guard declaration's flags and rules, as the parser applies them."""

import pytest

from miles.arguments.parser import parse_args

BASE = ["--hf-checkpoint", "builtin:tiny-shapes", "--prompt-data", "builtin:shapes"]


def parse_error(capsys, *argv):
    with pytest.raises(SystemExit):
        parse_args([*BASE, *argv])
    return capsys.readouterr().err


def test_defaults():
    guard = parse_args([*BASE, "--loss-type", "grpo_guard"])
    assert guard.grpo_guard_clip_range == 2e-6 and not guard.grpo_guard_no_step_reweight


def test_the_rules_name_the_flags(capsys):
    assert "--diffusion-sde-type" in parse_error(capsys, "--loss-type", "grpo_guard", "--diffusion-sde-type", "ode")
    assert "--grpo-guard-clip-range" in parse_error(capsys, "--loss-type", "grpo_guard", "--grpo-guard-clip-range", "0")
    err = parse_error(capsys, "--loss-type", "policy_loss", "--grpo-guard-no-step-reweight")
    assert "--grpo-guard-no-step-reweight only apply to --loss-type grpo_guard" in err
