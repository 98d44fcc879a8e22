"""MixGRPO-Flash through the driver on the shipped tiny model: the window's train pairs are the rollout's, so the
first update's ratio is exactly 1 and the train-side log-probs match the engine's to fp32 rounding."""

import os

import pytest

import train_diffusion
from miles.arguments.parser import parse_args
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e
BRIGHTNESS = os.path.join(os.path.dirname(__file__), "rewards.py") + ":brightness"


def test_flash_window_ratio_is_one_and_log_probs_match_before_first_update(ray_cluster, tmp_path):
    args = parse_args(
        [
            "--loss-type", "policy_loss", "--hf-checkpoint", "builtin:tiny-shapes", "--prompt-data", "builtin:shapes",
            "--custom-rm-path", BRIGHTNESS, "--dp-size", "1", "--num-rollout", "1", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "1", "--micro-batch-size", "4",
            "--diffusion-num-steps", "8", "--mixgrpo-window-size", "2", "--mixgrpo-flash", "--rollout-seed", "3",
            "--diffusion-guidance-scale", "1.0", "--eval-interval", "0", "--image-grid-interval", "0",
            "--output-dir", str(tmp_path), "--no-progress", "--log-level", "WARNING",
        ]
    )  # fmt: skip
    train_diffusion.run(args)
    window = next(m for m in read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if m.get("role") == "actor")
    assert window["train/ratio_mean"] == 1.0
    assert window["train/log_prob_abs_diff"] < 1e-6
    assert window["train/clipfrac"] == 0.0
