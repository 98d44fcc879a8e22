"""A loss type registered by --algorithm-path trains through the driver at dp size 2 (its hooks run in the
trainer actors, its rollout entry in the driver), and one declared without hub entries fails before any actor starts
(one not even declared fails at parse time: tests/fast/test_examples.py)."""

from pathlib import Path

import pytest

import train_diffusion
from miles.utils.arguments import parse_args
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e
EXAMPLE = str(Path(__file__).parents[2] / "examples" / "advantage_weighted_fm.py")


def plugin_args(out, loss_type="awfm", plugin=EXAMPLE):
    return parse_args(
        [
            "--algorithm-path", plugin, "--loss-type", loss_type, "--hf-checkpoint", "builtin:tiny-shapes",
            "--prompt-data", "builtin:shapes", "--dp-size", "2", "--num-rollout", "1", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--diffusion-num-steps", "4", "--diffusion-guidance-scale", "1.0",
            "--micro-batch-size", "4", "--eval-interval", "0", "--image-grid-interval", "0", "--output-dir", str(out),
            "--no-progress", "--log-level", "WARNING",
        ]
    )  # fmt: skip


def test_a_plugin_loss_type_trains_end_to_end(ray_cluster, tmp_path):
    train_diffusion.run(plugin_args(tmp_path))
    windows = [m for m in read_metrics(tmp_path / "metrics.jsonl") if m.get("role") == "actor"]
    assert len(windows) == 1
    assert windows[0]["train/loss"] > 0 and windows[0]["train/grad_norm"] > 0
    assert 0 < windows[0]["train/imitated_frac"] < 1


def test_a_loss_type_without_entries_fails_before_any_actor(ray_cluster, tmp_path):
    declared_only = tmp_path / "declared_only.py"
    declared_only.write_text(
        "from miles.algorithms import Algorithm, register_algorithm\n\nregister_algorithm(Algorithm(name='nope'))\n"
    )
    with pytest.raises(ValueError, match="no loss hooks registered for --loss-type nope"):
        train_diffusion.run(plugin_args(tmp_path, loss_type="nope", plugin=str(declared_only)))
