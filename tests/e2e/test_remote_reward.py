"""A Flow-GRPO run scored by a reward server (`--rm-url`) next to the same reward in process: equal rewards; the
server killed before rollout 1 stops the run naming the URL and the rollout, with rollout 0's checkpoint kept."""

import json
import os

import pytest

import train_diffusion
from miles.backends.fsdp_utils.checkpoint import checkpoint_dir, read_latest
from miles.ray.rollout_manager import RolloutManager
from miles.rollout.rm_hub import RewardError
from miles.utils.locks import FolderLock
from tests.e2e.test_policy_loss import BRIGHTNESS, policy_args
from tests.fast.rollout.rm_hub.reward_processes import reward_server

pytestmark = pytest.mark.e2e


def test_served_reward_equals_in_process_and_a_killed_server_stops_the_run(ray_cluster, tiny_pipeline_dir, tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "run"
    with reward_server("--custom-rm-path", BRIGHTNESS) as (process, url):
        args = policy_args(
            tiny_pipeline_dir,
            out,
            "--rm-type",
            "custom",
            "--rm-url",
            url,
            "--rm-url-weight",
            "0.0",  # logged, not trained on: the run trains on the in-process brightness
            "--rm-retries",
            "1",
            "--rm-retry-backoff",
            "0.05",
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "2",
            "--diffusion-num-steps",
            "4",
            "--save",
            ckpt,
            "--save-interval",
            "1",
        )
        real_rollout = RolloutManager._rl_rollout

        def kill_the_server_at_rollout_1(self, rollout_id):
            if rollout_id == 1:
                process.kill()
                process.wait(timeout=30)
            return real_rollout(self, rollout_id)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RolloutManager, "_rl_rollout", kill_the_server_at_rollout_1)
            with pytest.raises(RewardError) as info:
                train_diffusion.run(args)
    message = str(info.value)
    assert f"reward 'remote0': {url}/score failed to score samples 0..7 after 2 attempt(s)" in message
    assert "ConnectError" in message and message.endswith("[score of rollout 1]")
    with open(out / "metrics.jsonl") as f:
        rollout_0 = next(m for m in map(json.loads, f) if "rollout/reward_remote0_mean" in m)
    assert rollout_0["rollout_id"] == 0
    assert rollout_0["rollout/reward_remote0_mean"] == rollout_0["rollout/reward_custom_mean"]
    assert rollout_0["rollout/reward_mean"] == rollout_0["rollout/reward_custom_mean"]  # weight 0: not in the total
    assert read_latest(ckpt) == 0 and os.path.isdir(checkpoint_dir(ckpt, 0, "actor"))  # rollout 0's save kept
    FolderLock(ckpt, "--save").release()
