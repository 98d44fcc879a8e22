"""The embedded default (§9): Flow-GRPO from the shipped shapes model improves held-out shapes evaluation."""

import os

import pytest

import train_diffusion
from miles.models.builtin import SHIPPED_SHAPES_DIR
from miles.utils.arguments import parse_args
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e


def test_shipped_model_loads_in_plain_diffusers_and_draws_shapes():
    import numpy as np
    import torch
    from diffusers import StableDiffusion3Pipeline

    from miles.rollout.rm_hub.shapes import shapes_reward

    pipe = StableDiffusion3Pipeline.from_pretrained(SHIPPED_SHAPES_DIR)
    images = pipe(
        ["two red circles on the left"] * 4,
        num_inference_steps=20,
        guidance_scale=4.5,
        height=32,
        width=32,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    scores = shapes_reward(
        [(np.asarray(im) * 255).round().astype("uint8") for im in images],
        [{"color": "red", "shape": "circle", "count": 2, "position": "left"}] * 4,
    )
    assert np.mean([s.color for s in scores]) > 0.5  # recognisable red ink, where a random model draws noise


def test_policy_loss_from_the_shipped_model_raises_held_out_reward(ray_cluster, tmp_path):
    args = parse_args(
        [
            "--num-rollout",
            "20",
            "--eval-interval",
            "20",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
            "--log-level",
            "WARNING",
        ]
    )
    train_diffusion.run(args)
    evals = [m for m in read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if "eval/shapes_accuracy" in m]
    assert len(evals) == 2
    before, after = evals[0]["eval/shapes_reward_mean"], evals[-1]["eval/shapes_reward_mean"]
    # measured with these defaults (seed 1234): 0.801 -> 0.809 after 20 rollouts, 0.823 after 40 (accuracy
    # 0.26 -> 0.32); the eval is deterministic, so the difference comes from training alone
    assert after - before > 0.004, (before, after)
