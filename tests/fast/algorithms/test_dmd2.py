"""The dmd2 declaration: it distills the model itself without --teacher-load, refuses a sampling guidance scale (its
real score's is --dmd2-real-guidance-scale), and owns the critic role's overrides."""

from __future__ import annotations

from miles.arguments.parser import parse_args
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
