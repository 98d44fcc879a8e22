"""The reward-hacking monitors through the driver: a reward that pays for brightness alone makes the trained tiny
shapes model paint its samples white (the shapes fade: brightness up, saturation and diversity down); the console
warns once per condition, and metrics.jsonl and metrics.png carry the statistics."""

import logging
import os

import pytest

import train_diffusion
from miles.plot import plot_panels
from miles.utils.tracking import read_metrics
from tests.e2e.test_policy_loss import policy_args

pytestmark = pytest.mark.e2e
# measured (the default seeds, and --rollout-seed 7 --seed 3): brightness 0.935 -> 0.987 and 0.940 -> 0.989 after one
# update, pixel diversity 0.15 -> 0.03 and 0.14 -> 0.02
DRIFT = 0.03  # --monitor-image-drift for this test


def test_a_brightness_reward_drifts_brightness_and_the_warning_fires_once(ray_cluster, tmp_path, caplog):
    args = policy_args(
        "builtin:tiny-shapes",
        tmp_path,
        "--dp-size",
        "1",
        "--num-rollout",
        "4",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--micro-batch-size",
        "32",
        "--diffusion-num-steps",
        "4",
        "--lr",
        "1e-2",
        "--diffusion-clip-range",
        "0.2",
        "--image-grid-interval",
        "0",
        "--monitor-image-drift",
        str(DRIFT),
    )
    with caplog.at_level(logging.WARNING, logger="miles.rollout.monitors"):
        train_diffusion.run(args)
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    rollouts = [m for m in records if "monitor/x0_brightness_mean" in m]
    assert [m["rollout_id"] for m in rollouts] == [0, 1, 2, 3]
    brightness = [m["monitor/x0_brightness_mean"] for m in rollouts]
    assert brightness[-1] - brightness[0] > DRIFT, brightness  # the reward pays for brightness: it rises
    messages = [r.getMessage() for r in caplog.records]
    drifts = [m for m in messages if "monitor/x0_brightness_mean drifted" in m]
    assert len(drifts) == 1, messages  # once, however many rollouts stay beyond the threshold
    first = next(m["rollout_id"] for m in rollouts if abs(m["monitor/x0_brightness_mean"] - brightness[0]) > DRIFT)
    assert drifts[0].startswith(f"rollout {first}: ") and f"--monitor-image-drift {DRIFT:g})" in drifts[0]
    assert all(m["monitor/alerts"] >= 1 for m in rollouts[first:]) and rollouts[0]["monitor/alerts"] == 0
    collapses = [m for m in messages if "monitor/diversity_pixel fell" in m]  # white images all look alike
    assert len(collapses) == 1 and "--monitor-diversity-collapse 0.5" in collapses[0], messages
    panels = dict(plot_panels(records, "policy_loss"))
    assert "monitor/x0_brightness_mean" in panels["decoded brightness / saturation"]
    assert "monitor/diversity_pixel" in panels["diversity within prompt groups"]
    assert os.path.isfile(os.path.join(tmp_path, "metrics.png"))
