"""A whole (tiny) run with --use-tensorboard and --use-wandb (offline): what they hold is what metrics.jsonl holds,
plus every rollout and eval grid; the plot lies beside metrics.jsonl."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from PIL import Image

import train_diffusion
from miles.arguments.parser import parse_args
from miles.utils.tracking import EVAL_AXIS, read_metrics, scalar_points

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "fast", "utils"))
from tracker_readers import read_tensorboard, read_wandb_offline  # noqa: E402

pytestmark = pytest.mark.e2e


def test_tensorboard_and_offline_wandb_hold_every_metric_and_grid_of_a_run(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = parse_args(
        [
            *("--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4"),
            *("--diffusion-num-steps", "4", "--micro-batch-size", "4", "--diffusion-eval-num-steps", "4"),
            *("--eval-num-prompts", "4", "--eval-interval", "1", "--image-grid-interval", "1"),
            *("--use-tensorboard", "--use-wandb", "--wandb-run-name", "e2e"),
            *("--output-dir", str(tmp_path), "--no-progress", "--log-level", "WARNING"),
        ]
    )
    summary = train_diffusion.run(args)
    assert summary["plot"] == str(tmp_path / "metrics.png") and os.path.getsize(summary["plot"]) > 0

    expected = {
        (tag, x): value for r in read_metrics(tmp_path / "metrics.jsonl") for tag, _, x, value in scalar_points(r)
    }
    keys = {k for r in read_metrics(tmp_path / "metrics.jsonl") for k in r} - {"rollout_id", "step", "role"}
    assert {tag for tag, _ in expected} == keys  # nft trains the actor only: tags are the metrics.jsonl keys
    assert {"train/loss", "rollout/reward_mean", "eval/shapes_accuracy", "perf/train_s"} <= keys
    rollouts = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "perf/generate_total_s" in r]
    assert ["perf/startup_s" in r for r in rollouts] == [True, False]  # the first rollout's record only
    assert 0 < rollouts[0]["perf/startup_s"] < summary["wall_s"]

    scalars, images = read_tensorboard(str(tmp_path / "tensorboard"))
    got = {(tag, step): value for tag, steps in scalars.items() for step, value in steps.items()}
    assert got.keys() == expected.keys()
    assert [got[k] for k in expected] == pytest.approx(list(expected.values()), rel=1e-6)
    grids = {name: np.asarray(Image.open(tmp_path / "images" / name)) for name in os.listdir(tmp_path / "images")}
    assert sorted(grids) == ["eval_0000000.png", "eval_0000001.png", "eval_0000002.png", "rollout_0000000.png",
                             "rollout_0000001.png"]  # fmt: skip
    for name, pixels in grids.items():
        kind, number = name[: -len(".png")].split("_")
        np.testing.assert_array_equal(images[f"{kind}/images"][int(number)], pixels)

    rows, files = read_wandb_offline(str(tmp_path / "wandb"))
    axis_of = {tag: axis for r in read_metrics(tmp_path / "metrics.jsonl") for tag, axis, _, _ in scalar_points(r)}
    logged = {(tag, row[axis_of[tag]]): value for row in rows for tag, value in row.items() if tag in axis_of}
    assert logged == pytest.approx(expected)
    wandb_grids = {
        f"{kind}_{row[axis]:07d}.png": np.asarray(Image.open(os.path.join(files, row[f"{kind}/images"]["path"])))
        for row in rows
        for kind, axis in (("rollout", "rollout_id"), ("eval", EVAL_AXIS))
        if f"{kind}/images" in row
    }
    assert wandb_grids.keys() == grids.keys()
    for name, pixels in grids.items():
        np.testing.assert_array_equal(wandb_grids[name], pixels)
