"""A reward-gradient loss through the driver on 2 ranks: DRaFT-K (K = 2) on the tiny shapes model with the learned
image reward trained and the programmatic gold logged at weight 0. The trunk's differentiable unroll reproduces the
engine's final latents before the first update (the first-step parity), the reward's gradient reaches the weights,
and the gold is scored only on the rollout side."""

import os

import pytest

import train_diffusion
from miles.arguments.parser import parse_args
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e


def test_draft_k_runs_with_first_step_parity_and_a_logged_gold(ray_cluster, tiny_pipeline_dir, tmp_path):
    args = parse_args(
        ["--loss-type", "draft", "--draft-k", "2", "--rm-type", "shapes_learned,shapes:0",
         "--hf-checkpoint", tiny_pipeline_dir, "--prompt-data", "builtin:shapes", "--dp-size", "2",
         "--rollout-batch-size", "4", "--n-samples-per-prompt", "1", "--micro-batch-size", "1",
         "--diffusion-num-steps", "4", "--num-rollout", "1", "--eval-interval", "0", "--image-grid-interval", "0",
         "--output-dir", str(tmp_path), "--no-progress", "--log-level", "WARNING"]
    )  # fmt: skip
    train_diffusion.run(args)
    metrics = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    windows = [m for m in metrics if m.get("role") == "actor"]
    rollouts = [m for m in metrics if "rollout/reward_mean" in m]
    assert len(windows) == 1 and len(rollouts) == 1
    assert max(m["train/draft_final_abs_diff"] for m in windows) < 1e-5  # x_N(trainer) = x_N(engine)
    assert all(m["train/grad_norm"] > 0 for m in windows)
    for m in rollouts:  # the trained proxy is the whole reward; the gold only logged
        assert m["rollout/reward_mean"] == pytest.approx(m["rollout/reward_shapes_learned_mean"], abs=1e-6)
        assert "rollout/reward_shapes_mean" in m
    # the trainer's proxy score of x_N equals the rollout's (decoded in float vs. scored from uint8 images)
    assert windows[0]["train/reward_mean"] == pytest.approx(rollouts[0]["rollout/reward_mean"], abs=0.02)
