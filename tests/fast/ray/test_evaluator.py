"""The evaluator's record: the flags it reads itself, at their defaults and as parsed (the guidance scale after the
computed defaults)."""

from __future__ import annotations

from miles.algorithms import get_algorithm
from miles.arguments.parser import default_args, parse_args
from miles.ray.evaluator import EvalFlags, Evaluator


def test_the_eval_record_holds_the_evaluators_flags(tmp_path):
    defaults = EvalFlags.from_args(default_args())
    assert (defaults.n_samples_per_eval_prompt, defaults.eval_seed, defaults.ocr_num_threads) == (1, 0, 1)
    assert (defaults.diffusion_guidance_scale, defaults.resolution, defaults.negative_prompt) == (None, None, "")
    args = parse_args(
        [
            "--hf-checkpoint", "unused", "--prompt-data", "builtin:shapes", "--loss-type", "policy_loss",
            "--eval-num-prompts", "2", "--n-samples-per-eval-prompt", "3", "--eval-seed", "9", "--resolution", "32",
            "--negative-prompt", "blurry", "--output-dir", str(tmp_path), "--media-max-samples", "2",
        ]
    )  # fmt: skip
    flags = EvalFlags.from_args(args)
    assert (flags.loss_type, flags.n_samples_per_eval_prompt, flags.eval_seed, flags.resolution) == (
        "policy_loss",
        3,
        9,
        32,
    )
    assert (flags.negative_prompt, flags.output_dir, flags.media_max_samples) == ("blurry", str(tmp_path), 2)
    assert flags.diffusion_guidance_scale == get_algorithm("policy_loss").guidance_scale  # the computed default
    assert Evaluator(args).flags == flags
