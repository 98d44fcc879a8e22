"""AWM through the driver (dp 1, the tiny model, one rollout of two windows; the KL to `ref` is the generic reference
other e2e runs cover, and LoRA would triple this run's time, so β = 0 here):
the first window's ratio is exactly 1, the recompute pass gives window 1 its pre-update log-prob, the EMA anchor
starts at the trained weights (its per-rollout step, `decay_ema_anchor`, runs at the end: a name the declaration does
not hold would fail there)."""

import os

import pytest

import train_diffusion
from miles.arguments.parser import parse_args
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e
BRIGHTNESS = os.path.join(os.path.dirname(__file__), "rewards.py") + ":brightness"


def test_awm_first_ratio_is_one_and_window_one_gets_the_recomputed_old_log_prob(
    ray_cluster, tiny_pipeline_dir, tmp_path
):
    args = parse_args(
        [
            "--loss-type",
            "awm",
            "--hf-checkpoint",
            tiny_pipeline_dir,
            "--prompt-data",
            "builtin:shapes",
            "--custom-rm-path",
            BRIGHTNESS,
            "--awm-kl-beta",
            "0",
            "--lr",
            "3e-3",
            "--diffusion-num-steps",
            "4",
            "--awm-train-timesteps",
            "2",  # int(0.9·4) = 3: strata [1, 2) and [2, 3)
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--globalize-reward-std",
            "--num-steps-per-rollout",
            "2",
            "--micro-batch-size",
            "2",
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
        ]
    )
    assert args.diffusion_recompute_old_log_prob  # the declaration's derived default
    train_diffusion.run(args)
    windows = [m for m in read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if m.get("role") == "actor"]
    assert [(w["rollout_id"], w["step"]) for w in windows] == [(0, 1), (0, 2)]
    first, second = windows
    assert first["train/awm_ratio_mean"] == 1.0 and first["train/awm_clipfrac"] == 0.0
    assert first["train/ema_kl"] == 0.0  # the anchor starts as the trained weights
    # window 1's logp_old is the recompute pass's, taken before window 0's update (NaN if never written: skipped)
    assert first["train/skipped_steps"] == 0.0 and second["train/skipped_steps"] == 0.0
    assert second["train/awm_ratio_mean"] != 1.0 and abs(second["train/awm_ratio_mean"] - 1.0) < 0.5
    assert second["train/ema_kl"] > 0.0  # the update moved the policy off the anchor
