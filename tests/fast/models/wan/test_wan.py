"""The text-to-video Wan family's run: what its start-up refuses before Ray (the family's options and checks, the
image-only shapes reward and eval)."""

from __future__ import annotations

import pytest


def test_startup_refuses_what_a_wan_run_cannot_do(tiny_wan_dir, tiny_wan_2_experts_dir):
    """The driver's start-up check, before Ray: the family's options and checks, and the image-only shapes eval."""
    from miles.arguments.parser import parse_args
    from miles.models.builtin import resolve_checkpoint
    from miles.startup import check_startup

    def check(path, *flags):
        check_startup(parse_args(["--hf-checkpoint", path, "--num-frames", "5", *flags]))

    check(tiny_wan_2_experts_dir, "--loss-type", "nft", "--eval-interval", "0", "--wan-trained-experts", "low-noise")
    with pytest.raises(ValueError, match="--use-lora with a two-expert Wan folder"):
        check(tiny_wan_2_experts_dir, "--eval-interval", "0", "--use-lora")
    with pytest.raises(ValueError, match="--wan-trained-experts high-noise: .* has one expert"):
        check(tiny_wan_dir, "--eval-interval", "0", "--wan-trained-experts", "high-noise")
    check(tiny_wan_dir, "--loss-type", "nft")  # nft on builtin:shapes evaluates by default, but not video families
    with pytest.raises(ValueError, match=r"--rm-type shapes scores images \(sample.image\), and wan makes video"):
        check(tiny_wan_dir, "--loss-type", "nft", "--rm-type", "shapes")  # a video family's default is a video reward
    with pytest.raises(ValueError, match="shapes eval scores images, and wan makes video"):
        check(tiny_wan_dir, "--loss-type", "nft", "--eval-interval", "5")
    moving = ("--eval-prompt-data", "builtin:moving-shapes", "--eval-interval", "5")
    check(tiny_wan_dir, "--loss-type", "nft", *moving)  # the video world's eval scores clips
    with pytest.raises(ValueError, match="builtin:moving-shapes scores clips, and sd3 makes images"):
        shapes_model = resolve_checkpoint("builtin:tiny-shapes")
        check_startup(parse_args(["--hf-checkpoint", shapes_model, "--loss-type", "nft", *moving]))
