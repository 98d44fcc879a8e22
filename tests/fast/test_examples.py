"""The worked example of a loss type added from outside miles (examples/advantage_weighted_fm.py)."""

from pathlib import Path

import pytest
import torch

from miles.arguments.parser import parse_args
from miles.utils.misc import load_module

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "advantage_weighted_fm.py")
BASE = ["--hf-checkpoint", "builtin:tiny-shapes", "--prompt-data", "builtin:shapes"]


def test_the_example_registers_both_sides_of_its_loss_type():
    from miles.algorithms import get_algorithm
    from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, check_loss_hooks
    from miles.rollout.rollout_hub import RolloutSpec, get_rollout_spec

    load_module(EXAMPLE)
    check_loss_hooks(LOSS_HOOKS[("awfm", "actor")])
    assert get_algorithm("awfm").scores_rewards  # GRPO advantages weight its pairs
    assert isinstance(get_rollout_spec("awfm"), RolloutSpec)


def test_the_example_loss_matches_a_hand_computation():
    loss_fn = load_module(EXAMPLE).advantage_weighted_fm_loss
    v, noise, x0 = torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    advantage = torch.tensor([2.0, -1.0, 9.0])
    got = loss_fn(v, noise, x0, advantage, 5.0)
    for i, weight in enumerate([2.0 / 5.0, 0.0, 1.0]):
        expected = (
            weight
            * sum(float(v[i].flatten()[k] - noise[i].flatten()[k] + x0[i].flatten()[k]) ** 2 for k in range(8))
            / 8
        )
        assert got[i].item() == pytest.approx(expected, rel=1e-5)


def test_an_unknown_loss_type_names_the_choices_and_the_plugin_flag(capsys):
    with pytest.raises(SystemExit):  # a name no module declared (the example's awfm may be registered by now)
        parse_args([*BASE, "--loss-type", "awfm_undeclared"])
    err = capsys.readouterr().err
    assert "awfm_undeclared" in err and "--algorithm-path" in err and "policy_loss" in err


def test_a_plugin_that_fails_to_import_names_the_flag(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--loss-type", "x", "--algorithm-path", str(broken)])
    err = capsys.readouterr().err
    assert "--algorithm-path" in err and str(broken) in err and "boom" in err


DANCE = str(Path(__file__).parents[2] / "examples" / "dance_grpo_steps.py") + ":random_steps"


def test_the_dance_grpo_strategy_trains_a_seeded_random_60_percent_of_the_steps():
    from miles.rollout.step_strategy_hub import select_trained_steps

    args = parse_args(
        [
            *BASE,
            "--loss-type",
            "policy_loss",
            "--diffusion-sde-type",
            "dance",
            "--diffusion-num-steps",
            "16",
            "--diffusion-step-strategy-path",
            DANCE,
        ]
    )
    draws = [select_trained_steps(args, rollout_id) for rollout_id in range(20)]
    for steps in draws:  # validated by the strategy hub: sorted, unique, never the last step
        assert len(steps) == 9 and steps == sorted(set(steps)) and 0 <= steps[0] and steps[-1] <= 14
    assert draws[0] == select_trained_steps(args, 0)
    assert len({tuple(s) for s in draws}) == 20  # a fresh subset each rollout, not a window
    assert any(steps != list(range(steps[0], steps[0] + 9)) for steps in draws)
    counts = [sum(i in steps for steps in draws) for i in range(15)]
    assert min(counts) > 0  # over 20 rollouts every trainable step is drawn
