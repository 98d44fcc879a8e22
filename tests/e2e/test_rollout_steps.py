"""Rollout-step path flags through the driver: a dynamic-sampling filter refills the batch with groups that have
reward spread, a sample filter zeroes its samples' advantages, a data source supplies the prompts; a bad hook
fails before any actor starts, naming the flag and the file."""

import os

import pytest
import torch

import train_diffusion
from miles.arguments.parser import parse_args
from miles.utils.misc import HookLoadError
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e
HOOKS = os.path.join(os.path.dirname(__file__), "rollout_hooks.py")
GROUPS, PER_GROUP = 4, 2


def steps_args(pipeline_dir, out, *extra):
    return parse_args(
        [
            "--loss-type", "policy_loss", "--hf-checkpoint", pipeline_dir, "--prompt-data", "builtin:shapes",
            "--dp-size", "1", "--num-rollout", "1", "--rollout-batch-size", str(GROUPS),
            "--n-samples-per-prompt", str(PER_GROUP), "--diffusion-num-steps", "4", "--diffusion-num-sde-steps", "1",
            "--diffusion-guidance-scale", "1.0", "--custom-rm-path", f"{HOOKS}:half_constant", "--rm-type", "custom",
            "--eval-interval", "0", "--image-grid-interval", "0", "--output-dir", str(out), "--no-progress",
            "--log-level", "WARNING", *extra,
        ]
    )  # fmt: skip


def test_filters_and_data_source_shape_the_rollout(ray_cluster, tiny_pipeline_dir, tmp_path):
    saved = tmp_path / "pairs"
    args = steps_args(
        tiny_pipeline_dir,
        tmp_path / "run",
        "--debug-rollout-only",
        "--save-debug-rollout-data", str(saved),
        "--data-source-path", f"{HOOKS}:cycle_prompts",
        "--dynamic-sampling-filter-path", f"{HOOKS}:keep_spread",
        "--rollout-sample-filter-path", f"{HOOKS}:remove_first_of_group",
    )  # fmt: skip
    train_diffusion.run(args)
    pairs = torch.load(saved / "rollout_0000000.pt", weights_only=True)
    advantage = pairs["advantage"]
    assert advantage.shape[0] == GROUPS * PER_GROUP, "the batch was not refilled to full size"
    record = next(m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "rollout/reward_mean" in m)
    assert record["rollout/dynamic_sampling_rounds"] >= 1, "the first round had only groups with spread"
    assert record["rollout/removed_samples_frac"] == pytest.approx(0.5)
    # the first sample of every group was removed (advantage 0); each kept group has spread, so the others are not 0
    assert (advantage == 0).sum().item() == GROUPS
    assert (advantage != 0).sum().item() == GROUPS * (PER_GROUP - 1)
    # an odd-length prompt has spread: the kept groups are exactly those (the data source has three of five)
    assert record["rollout/reward_mean"] != pytest.approx(0.5)


def test_a_hook_with_the_wrong_signature_fails_before_any_actor_starts(ray_cluster, tiny_pipeline_dir, tmp_path):
    import miles.ray.engine_group as engine_group
    import miles.ray.train_group as train_group

    args = steps_args(tiny_pipeline_dir, tmp_path, "--dynamic-sampling-filter-path", f"{HOOKS}:bad_filter")
    started = []
    real = (train_group.RayTrainGroup.__init__, engine_group.RolloutEngineGroup.__init__)
    try:
        train_group.RayTrainGroup.__init__ = lambda *a, **k: started.append("trainer")
        engine_group.RolloutEngineGroup.__init__ = lambda *a, **k: started.append("engine")
        with pytest.raises(
            HookLoadError, match=r"--dynamic-sampling-filter-path .*rollout_hooks.py.*fn\(args, group\)"
        ):
            train_diffusion.run(args)
    finally:
        train_group.RayTrainGroup.__init__, engine_group.RolloutEngineGroup.__init__ = real
    assert started == []
