"""The RL flags' MixGRPO window: its flags need the window, each rule names both flags it weighs, and only a loss
type that samples SDE steps takes it."""

from __future__ import annotations

import pytest

from miles.arguments.parser import parse_args
from tests.fast.arguments.test_parser import BASE, parse_error

POLICY = BASE + ["--loss-type", "policy_loss", "--diffusion-num-steps", "10"]


def test_mixgrpo_window_parses_and_its_flags_need_it(capsys):
    args = parse_args(POLICY + ["--mixgrpo-window-size", "4", "--mixgrpo-flash", "--mixgrpo-flash-ratio", "0.5"])
    assert (args.mixgrpo_window_size, args.mixgrpo_flash, args.mixgrpo_flash_ratio) == (4, True, 0.5)
    err = parse_error(POLICY + ["--mixgrpo-flash", "--mixgrpo-stride", "2"], capsys)
    assert "--mixgrpo-stride, --mixgrpo-flash need --mixgrpo-window-size" in err
    assert "--mixgrpo-flash-ratio needs --mixgrpo-flash" in parse_error(
        POLICY + ["--mixgrpo-window-size", "4", "--mixgrpo-flash-ratio", "0.5"], capsys
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--diffusion-num-sde-steps", "2"], "--mixgrpo-window-size and --diffusion-num-sde-steps both choose"),
        (["--diffusion-sde-window-range", "0,5"], "--mixgrpo-window-size and --diffusion-sde-window-range both choose"),
        (["--diffusion-step-strategy-path", "m.f"], "--mixgrpo-window-size and --diffusion-step-strategy-path both"),
        (["--mixgrpo-window-size", "9"], "--mixgrpo-window-size 9 must be <= --diffusion-num-steps 10 - 2"),
        (
            ["--mixgrpo-mode", "random", "--mixgrpo-shift-interval", "5"],
            "--mixgrpo-shift-interval move the progressive",
        ),
        (["--mixgrpo-window-size", "0"], "--mixgrpo-window-size must be ≥ 1"),
        (["--mixgrpo-flash", "--mixgrpo-flash-ratio", "0"], "--mixgrpo-flash-ratio must be in (0, 1]"),
        (["--diffusion-sde-type", "ode"], "--diffusion-sde-type ode has none"),
    ],
)
def test_mixgrpo_rules_name_both_flags(extra, message, capsys):
    window = [] if "--mixgrpo-window-size" in extra else ["--mixgrpo-window-size", "4"]
    assert message in parse_error(POLICY + window + extra, capsys)


def test_mixgrpo_needs_an_sde_sampling_loss_type(capsys):
    assert "--loss-type nft samples no SDE" in parse_error(
        BASE + ["--loss-type", "nft", "--mixgrpo-window-size", "2"], capsys
    )
