"""What the reward-gradient declarations share, through the parser: the shared flags are refl's and read by draft and
direct_align (refused elsewhere), the penalty needs a reference, and a weighted reward that cannot be back-propagated
is refused at start-up by name while a zero-weight gold is only logged."""

import pytest

from miles.algorithms.base import reward_gradient_rules
from miles.arguments.parser import default_args, parse_args

BASE = ["--rm-type", "shapes_learned,shapes:0"]


@pytest.mark.parametrize("loss_type", ["refl", "draft", "direct_align"])
def test_each_accepts_the_shared_flags_and_a_differentiable_reward_with_a_logged_gold(loss_type):
    args = parse_args(["--loss-type", loss_type, *BASE, "--reward-grad-hinge", "0.9", "--reward-grad-scale", "2"])
    assert (args.reward_grad_hinge, args.reward_grad_scale) == (0.9, 2.0)


@pytest.mark.parametrize("loss_type", ["refl", "draft", "direct_align"])
def test_a_non_differentiable_weighted_reward_is_refused_by_name(loss_type, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--loss-type", loss_type, "--rm-type", "shapes_learned,jpeg_compressibility:0.5"])
    err = capsys.readouterr().err
    assert f"--loss-type {loss_type} back-propagates the reward" in err
    assert "--rm-type jpeg_compressibility:0.5 is not differentiable" in err


def test_the_shared_flags_are_refused_where_nothing_reads_them(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--loss-type", "nft", "--reward-grad-hinge", "0.9"])
    assert "--reward-grad-hinge is read only by --loss-type refl, draft, direct_align" in capsys.readouterr().err


def test_the_penalty_needs_a_reference():
    args = default_args(loss_type="draft", reward_grad_kl_beta=0.1)
    assert reward_gradient_rules(args) == [
        "--reward-grad-kl-beta > 0 (--loss-type draft) needs a reference: --ref-mode lora_base or ema"
    ]
    assert reward_gradient_rules(default_args(loss_type="draft", reward_grad_kl_beta=0.1, ref_mode="ema")) == []
