"""The non-finite guard through the driver at dp size 2: a NaN loss on one rank skips the optimizer step on every
rank, is counted, and after --max-skipped-steps the run stops before saving; the last checkpoint is finite."""

import os

import pytest
import torch

import train_diffusion
from miles.arguments.parser import parse_args
from miles.backends.fsdp_utils.checkpoint import read_latest
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e
HOOKS = os.path.join(os.path.dirname(__file__), "nan_hooks.py")


def test_nan_skips_on_every_rank_then_stops_before_saving(ray_cluster, tiny_pipeline_dir, tmp_path):
    save = tmp_path / "ckpt"
    args = parse_args(
        [
            "--loss-type", "custom_loss", "--custom-prepare-train-batch-path", f"{HOOKS}:prepare",
            "--custom-loss-function-path", f"{HOOKS}:nan_from_rollout_1", "--hf-checkpoint", tiny_pipeline_dir,
            "--prompt-data", "builtin:shapes", "--dp-size", "2", "--num-rollout", "5", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--diffusion-num-steps", "4", "--diffusion-num-sde-steps", "1",
            "--micro-batch-size", "2", "--max-skipped-steps", "2", "--save", str(save), "--save-interval", "1",
            "--eval-interval", "0", "--image-grid-interval", "0", "--output-dir", str(tmp_path / "run"),
            "--no-progress", "--log-level", "ERROR",
        ]
    )  # fmt: skip
    with pytest.raises(Exception, match=r"2 consecutive optimizer steps skipped.*first non-finite: the loss at actor "
                                        r"rollout 1 window 0"):  # fmt: skip
        train_diffusion.run(args)
    windows = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if m.get("role") == "actor"]
    assert [w["train/skipped_steps"] for w in windows] == [0.0, 1.0]
    assert [w["step"] for w in windows] == [1, 1], "a skipped window advanced the optimizer step count"
    assert read_latest(str(save)) == 1, "the rollout whose step was skipped keeps its (finite) weights and saves"
    # the last checkpoint holds the weights after rollout 0's update (rollout 1's step was skipped): all finite
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_dir = next((save / "iter_0000001" / "actor").rglob("*.distcp")).parent
    dcp_to_torch_save(str(dcp_dir), str(tmp_path / "full.pt"))
    tensors = [v for v in _flatten(torch.load(tmp_path / "full.pt", weights_only=True)) if torch.is_tensor(v)]
    assert tensors and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


def _flatten(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _flatten(value)
    else:
        yield tree
