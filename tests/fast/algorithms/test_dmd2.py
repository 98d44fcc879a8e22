"""The dmd2 declaration: it distills the model itself without --teacher-load, refuses a sampling guidance scale (its
real score's is --dmd2-real-guidance-scale), owns the critic role's overrides, and needs a differentiable reward only
with --dmd2-reward-weight > 0."""

from __future__ import annotations

import pytest

from miles.algorithms.dmd2 import ALGORITHM as DMD2
from miles.arguments.parser import default_args, parse_args
from tests.fast.arguments.test_parser import BASE, SFT, parse_error


def test_dmd2_distills_the_model_itself_without_teacher_load():
    args = parse_args(BASE + ["--loss-type", "dmd2"])
    assert args.teacher_load == args.critic_checkpoint == "/tmp/x"  # the critic starts from the teacher
    assert any("--teacher-load is --hf-checkpoint /tmp/x" in note for note in args.default_notes)


def test_dmd2_rejects_a_sampling_guidance_scale(capsys):
    dmd2 = BASE + ["--loss-type", "dmd2", "--teacher-load", "/t"]
    err = parse_error(dmd2 + ["--diffusion-guidance-scale", "4.5"], capsys)
    assert "--diffusion-guidance-scale 4.5 does not apply to --loss-type dmd2" in err
    assert "--dmd2-real-guidance-scale" in err
    assert parse_args(dmd2 + ["--diffusion-guidance-scale", "1"]).diffusion_guidance_scale == 1.0


def test_critic_overrides_only_under_dmd2(capsys):
    err = parse_error(SFT + ["--critic-lr", "1e-5", "--critic-save", "/c"], capsys)
    assert "--critic-lr, --critic-save only apply to an algorithm with a critic role (dmd2)" in err
    assert "--loss-type sft_loss trains actor" in err
    args = parse_args(BASE + ["--loss-type", "dmd2", "--teacher-load", "/t", "--critic-lr", "1e-5"])
    assert args.critic_lr == 1e-5 and args.critic_checkpoint == "/t"
    assert args.critic_micro_batch_size == args.micro_batch_size


def test_a_reward_weight_needs_a_differentiable_reward_and_zero_keeps_plain_dmd2(capsys):
    assert not DMD2.differentiable_reward(default_args(loss_type="dmd2"))
    assert DMD2.differentiable_reward(default_args(loss_type="dmd2", dmd2_reward_weight=0.1))
    assert parse_args(["--loss-type", "dmd2", "--rm-type", "shapes"]).dmd2_reward_weight == 0.0
    guided = parse_args(["--loss-type", "dmd2", "--dmd2-reward-weight", "0.1"])
    assert guided.rm_type is None  # the default reward of a reward-guided run: the proxy, the gold logged
    with pytest.raises(SystemExit):
        parse_args(["--loss-type", "dmd2", "--dmd2-reward-weight", "0.1", "--rm-type", "shapes"])
    assert "--loss-type dmd2 back-propagates the reward" in capsys.readouterr().err
