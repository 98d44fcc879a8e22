"""GRPO-Guard and Flow-DPPO through the driver: the engine's recorded step means μ_old reach the train pairs, and
before the first update the ratio is 1 and the trainer's log-probs match the rollout's."""

import os

import pytest

import train_diffusion
from miles.arguments.parser import parse_args
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e
BRIGHTNESS = os.path.join(os.path.dirname(__file__), "rewards.py") + ":brightness"

# GRPO-Guard with its recipe's noise level and 2-step SDE window; Flow-DPPO on the DanceGRPO kernel (η 0.3)
EXTRA = {
    "grpo_guard": ("--diffusion-noise-level", "1.2", "--diffusion-num-sde-steps", "2"),
    "flow_dppo": ("--diffusion-sde-type", "dance", "--diffusion-noise-level", "0.3", "--diffusion-num-sde-steps", "0"),
}


@pytest.mark.parametrize("loss_type", ["grpo_guard", "flow_dppo"])
def test_ratio_is_one_and_log_probs_match_before_first_update(ray_cluster, tiny_pipeline_dir, tmp_path, loss_type):
    args = parse_args(
        [
            "--loss-type",
            loss_type,
            "--hf-checkpoint",
            tiny_pipeline_dir,
            "--prompt-data",
            "builtin:shapes",
            "--custom-rm-path",
            BRIGHTNESS,
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--diffusion-num-steps",
            "4",
            "--diffusion-guidance-scale",
            "1.0",
            "--num-steps-per-rollout",
            "1",
            "--micro-batch-size",
            "4",
            "--num-rollout",
            "1",
            "--eval-interval",
            "0",
            "--image-grid-interval",
            "0",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
            "--log-level",
            "WARNING",
            *EXTRA[loss_type],
        ]
    )
    train_diffusion.run(args)
    (window,) = [m for m in read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if m.get("role") == "actor"]
    assert window["train/ratio_mean"] == 1.0, window
    assert window["train/log_prob_abs_diff"] < 1e-6, window
    assert window["train/mean_abs_diff"] < 1e-6, window
    assert window["train/grad_norm"] > 0, window
