"""The flow_dppo declaration's flags and rules, as the parser applies them."""

import pytest

from miles.arguments.parser import parse_args

BASE = ["--hf-checkpoint", "builtin:tiny-shapes", "--prompt-data", "builtin:shapes"]


def parse_error(capsys, *argv):
    with pytest.raises(SystemExit):
        parse_args([*BASE, *argv])
    return capsys.readouterr().err


def test_defaults():
    assert parse_args([*BASE, "--loss-type", "flow_dppo"]).flow_dppo_kl_threshold == 1e-5


def test_the_rules_name_the_flags(capsys):
    err = parse_error(capsys, "--loss-type", "flow_dppo", "--diffusion-sde-type", "cps")
    assert "--diffusion-sde-type sde or dance" in err
    assert "--flow-dppo-kl-threshold" in parse_error(
        capsys, "--loss-type", "flow_dppo", "--flow-dppo-kl-threshold", "-1"
    )
    assert "--ref-mode" in parse_error(capsys, "--loss-type", "flow_dppo", "--diffusion-kl-beta", "0.1")
