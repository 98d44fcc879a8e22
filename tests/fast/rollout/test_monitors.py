"""The reward-hacking monitors, each statistic against a hand or plain-loop NumPy computation, and the drift watch
warning once per condition."""

import logging
import math

import numpy as np
import pytest

from miles.rollout.monitors import (
    DriftWatch,
    group_diversity,
    image_statistics,
    latent_norms,
    monitor_metrics,
    reward_correlations,
    thumbnail,
    watches,
)


def solid(rgb, size=4):
    return np.full((size, size, 3), rgb, dtype=np.uint8)


def test_brightness_and_saturation_of_solid_colours_by_hand():
    images = np.stack([solid((255, 0, 0)), solid((128, 128, 128)), solid((0, 0, 0)), solid((255, 255, 0))])
    stats = image_statistics(images)
    assert stats["brightness"] == pytest.approx([0.299, 128 / 255, 0.0, 0.299 + 0.587])
    assert stats["saturation"] == pytest.approx([1.0, 0.0, 0.0, 1.0])  # black: max 0, saturation 0
    half = np.zeros((2, 2, 3), dtype=np.uint8)
    half[0] = (200, 100, 50)  # saturation (200 - 50) / 200 on one row, black on the other
    stats = image_statistics(half[None])
    assert stats["saturation"][0] == pytest.approx(0.75 / 2)
    assert stats["brightness"][0] == pytest.approx((0.299 * 200 + 0.587 * 100 + 0.114 * 50) / 255 / 2)


def test_statistics_of_random_images_and_videos_match_plain_loops():
    rng = np.random.default_rng(0)
    videos = rng.integers(0, 256, (3, 2, 5, 6, 3), dtype=np.uint8)
    stats = image_statistics(videos)
    for i, video in enumerate(videos):
        pixels = [[c / 255.0 for c in p] for p in video.reshape(-1, 3).tolist()]
        luma = sum(0.299 * r + 0.587 * g + 0.114 * b for r, g, b in pixels) / len(pixels)
        sat = sum((max(p) - min(p)) / max(p) if max(p) > 0 else 0.0 for p in pixels) / len(pixels)
        assert stats["brightness"][i] == pytest.approx(luma) and stats["saturation"][i] == pytest.approx(sat)
    latents = rng.normal(size=(3, 4, 2, 2)).astype(np.float32)
    expected = [math.sqrt(sum(float(x) ** 2 for x in lat.ravel()) / lat.size) for lat in latents]
    assert latent_norms(latents) == pytest.approx(expected)


def test_thumbnails_block_average_large_images_and_keep_small_ones():
    small = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    assert np.array_equal(thumbnail(small), small.ravel() / 255.0)
    big = np.random.default_rng(1).integers(0, 256, (130, 100, 3), dtype=np.uint8)  # factor ceil(130 / 64) = 3
    feature = thumbnail(big).reshape(43, 33, 3)
    assert feature[2, 5] == pytest.approx(big[6:9, 15:18].reshape(-1, 3).mean(axis=0) / 255.0)


def test_group_diversity_is_the_mean_pairwise_distance_within_groups():
    rng = np.random.default_rng(2)
    features = rng.random((7, 5))
    groups = [[0, 1, 2], [3, 4, 5, 6]]

    def mean_pairs(rows, distance):
        pairs = [(i, j) for k, i in enumerate(rows) for j in rows[k + 1 :]]
        return sum(distance(features[i], features[j]) for i, j in pairs) / len(pairs)

    def rms(a, b):
        return float(np.linalg.norm(a - b) / math.sqrt(len(a)))

    def cosine(a, b):
        return 1.0 - float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

    for metric, distance in (("rms", rms), ("cosine", cosine)):
        expected = (mean_pairs(groups[0], distance) + mean_pairs(groups[1], distance)) / 2
        assert group_diversity(features, groups, metric) == pytest.approx(expected)
    assert group_diversity(features, [[0], [1]]) is None  # one sample per prompt: nothing to compare
    same = np.repeat(features[:1], 3, axis=0)
    assert group_diversity(same, [[0, 1, 2]]) == pytest.approx(0.0, abs=1e-7)  # collapsed group


def test_reward_correlations_match_numpy_and_skip_constant_rewards():
    rng = np.random.default_rng(3)
    a, b = rng.random(8), rng.random(8)
    got = reward_correlations({"shapes": a, "custom": b, "flat": np.ones(8)})
    assert got == {"shapes__custom": pytest.approx(np.corrcoef(a, b)[0, 1])}
    assert reward_correlations({"x": a, "y": -2 * a + 1})["x__y"] == pytest.approx(-1.0)


def test_monitor_metrics_name_mean_and_spread_and_correlate_only_several_rewards():
    images = np.stack([solid((255, 0, 0)), solid((255, 0, 0)), solid((0, 0, 255)), solid((0, 0, 0))])
    latents = np.stack([np.full((2, 2), v, dtype=np.float32) for v in (1.0, 2.0, 3.0, 4.0)])
    embeddings = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    metrics = monitor_metrics(images, latents, [[0, 1], [2, 3]], {"r": [1, 2, 3, 4]}, embeddings)
    brightness = np.array([0.299, 0.299, 0.114, 0.0])
    assert metrics["monitor/x0_brightness_mean"] == pytest.approx(brightness.mean())
    assert metrics["monitor/x0_brightness_std"] == pytest.approx(brightness.std())
    assert metrics["monitor/x0_saturation_mean"] == pytest.approx(0.75)
    assert (metrics["monitor/x0_norm_mean"], metrics["monitor/x0_norm_std"]) == pytest.approx(
        (2.5, np.std([1, 2, 3, 4]))
    )
    blue_vs_black = math.sqrt(255**2 / 3) / 255  # RMS over R, G, B of one pixel differing by 255 in B
    assert metrics["monitor/diversity_pixel"] == pytest.approx((0.0 + blue_vs_black) / 2)
    assert metrics["monitor/diversity_clip"] == pytest.approx((1.0 + 0.0) / 2)
    assert not any("reward_corr" in key for key in metrics)
    two = monitor_metrics(None, latents, [[0, 1, 2, 3]], {"a": [1, 2, 3, 4], "b": [4, 3, 2, 1]})
    assert two["monitor/reward_corr/a__b"] == pytest.approx(-1.0)
    assert "monitor/x0_brightness_mean" not in two and "monitor/diversity_pixel" not in two


def test_a_drift_is_warned_once_and_counted_every_rollout(caplog):
    watch = DriftWatch(watches(image_drift=0.1, norm_drift=0.25, diversity_collapse=0.5))
    series = [
        {"monitor/x0_brightness_mean": 0.50, "monitor/x0_norm_mean": 1.0, "monitor/diversity_pixel": 0.2},
        {"monitor/x0_brightness_mean": 0.58, "monitor/x0_norm_mean": 1.2, "monitor/diversity_pixel": 0.11},
        {"monitor/x0_brightness_mean": 0.61, "monitor/x0_norm_mean": 0.7, "monitor/diversity_pixel": 0.09},
        {"monitor/x0_brightness_mean": 0.65, "monitor/x0_norm_mean": 0.7, "monitor/diversity_pixel": 0.05},
        {"monitor/x0_brightness_mean": 0.52, "monitor/x0_norm_mean": 1.0, "monitor/diversity_pixel": 0.2},
    ]
    with caplog.at_level(logging.WARNING, logger="miles.rollout.monitors"):
        holding = [watch.check(rollout_id, metrics) for rollout_id, metrics in enumerate(series, start=3)]
    assert holding == [
        [],
        [],
        ["monitor/x0_brightness_mean", "monitor/x0_norm_mean", "monitor/diversity_pixel"],
        ["monitor/x0_brightness_mean", "monitor/x0_norm_mean", "monitor/diversity_pixel"],
        [],
    ]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3 and all(w.startswith("rollout 5: monitor/") for w in warnings)
    assert (
        "monitor/x0_brightness_mean drifted to 0.61 from its first value 0.5 (|change| 0.11 > --monitor-image-drift 0.1)"
        in warnings[0]
    )
    assert "(first value at rollout 3)" in warnings[0]
    assert "--monitor-norm-drift 0.25 x |1|" in warnings[1]
    assert (
        "monitor/diversity_pixel fell to 0.09, below --monitor-diversity-collapse 0.5 x its first value 0.2"
        in warnings[2]
    )


def test_a_zero_threshold_watches_nothing():
    assert [w.key for w in watches(0.0, 0.25, 0.0)] == ["monitor/x0_norm_mean"]


def test_the_conditions_that_held_are_kept_per_rollout_for_the_guard_and_taken_once():
    watch = DriftWatch(watches(image_drift=0.1, norm_drift=0.0, diversity_collapse=0.5))
    watch.check(0, {"monitor/x0_brightness_mean": 0.5, "monitor/diversity_pixel": 0.2})
    watch.check(1, {"monitor/x0_brightness_mean": 0.7, "monitor/diversity_pixel": 0.05})
    watch.check(2, {"monitor/x0_brightness_mean": 0.7, "monitor/diversity_pixel": 0.2})
    assert watch.pop_held(0) == []
    assert watch.pop_held(1) == [
        ("--monitor-image-drift", "monitor/x0_brightness_mean drifted to 0.7 from its first value 0.5 (|change| 0.2 > "
         "--monitor-image-drift 0.1)"),
        ("--monitor-diversity-collapse", "monitor/diversity_pixel fell to 0.05, below --monitor-diversity-collapse "
         "0.5 x its first value 0.2"),
    ]  # fmt: skip
    assert watch.pop_held(1) == [] and [flag for flag, _ in watch.pop_held(2)] == ["--monitor-image-drift"]
