"""`--monitor-action rollback` through the driver: the eval scores its samples with the trained reward (the proxy,
brightness) and the shapes reward (the gold), and a planted divergence (the proxy up, the gold down at the eval after
rollout 1) trips the proxy-gold monitor: every role restores the checkpoint of rollout 0 (bit for bit the weights
saved then), the latest pointer moves back to it, and the run goes on at half the learning rate.

The divergence is planted because the tiny model's eval does not diverge reliably within a few rollouts (measured:
at --lr 1e-2 the gold is near 0 from the first eval on); a whole run, 3 rollouts: ~45-55 s here (a loaded 2-core machine), so `standard`."""

import os

import pytest

import train_diffusion
from miles.backends.fsdp_utils.checkpoint import read_latest
from miles.ray.groups import RunGroups
from miles.ray.monitor_guard import ROLLBACK_TO_KEY, ROLLBACKS_KEY, TRIPPED_KEY, RunGuard
from miles.rollout.eval_rewards import EvalRewards
from miles.rollout.guard import GOLD_KEY, PROXY_KEY
from miles.utils.tracking import read_metrics
from tests.e2e.test_policy_loss import policy_args

pytestmark = [pytest.mark.e2e, pytest.mark.standard]
PLANTED = {1: (0.5, 0.7), 2: (0.6, 0.4), 3: (0.4, 0.6)}  # rollouts trained -> (proxy, gold)


def weights(run_groups_or_guard) -> dict:
    return run_groups_or_guard.groups["actor"].call("full_state_dict_every_rank")[0]


def test_a_diverging_proxy_rolls_back_to_the_checkpoint_before_it_and_halves_the_learning_rate(
    ray_cluster, tmp_path, monkeypatch
):
    saved, restored, scored = {}, {}, []
    save, rollback, metrics = RunGroups.save, RunGuard.rollback, EvalRewards.metrics

    def save_and_keep(self, rollout_id):
        seconds = save(self, rollout_id)
        saved[rollout_id] = weights(self)
        return seconds

    def rollback_and_keep(self, target, lr_factor, rollout_id):
        rollback(self, target, lr_factor, rollout_id)
        restored[target] = weights(self.run_groups)

    def planted(self, samples):
        scored.append(metrics(self, samples))  # what the eval's samples scored, then the planted series
        return dict(zip((PROXY_KEY, GOLD_KEY), PLANTED[len(scored)]))

    monkeypatch.setattr(EvalRewards, "metrics", planted)
    monkeypatch.setattr(RunGroups, "save", save_and_keep)
    monkeypatch.setattr(RunGuard, "rollback", rollback_and_keep)
    args = policy_args(
        "builtin:tiny-shapes", tmp_path,
        "--dp-size", "1", "--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--micro-batch-size", "8", "--diffusion-num-steps", "4", "--lr", "1e-3", "--diffusion-clip-range", "0.2",
        "--image-grid-interval", "0", "--eval-interval", "1", "--eval-num-prompts", "2", "--no-eval-before-train",
        "--diffusion-eval-num-steps", "4", "--gold-rm-type", "shapes",
        "--monitor-action", "rollback", "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
        "--monitor-image-drift", "0", "--monitor-norm-drift", "0", "--monitor-diversity-collapse", "0",
    )  # fmt: skip
    train_diffusion.run(args)
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    rollouts = [r for r in records if "role" not in r and TRIPPED_KEY in r]
    assert [(r[PROXY_KEY], r[GOLD_KEY]) for r in rollouts] == list(PLANTED.values())
    assert len(scored) == 3 and all(0.0 <= m[GOLD_KEY] <= 1.0 and 0.0 <= m[PROXY_KEY] <= 1.0 for m in scored)
    assert [r[TRIPPED_KEY] for r in rollouts] == [0, 1, 0] and [r[ROLLBACKS_KEY] for r in rollouts] == [0, 1, 1]
    assert rollouts[1][ROLLBACK_TO_KEY] == 0 and list(restored) == [0]
    assert all(restored[0][k].equal(v) for k, v in saved[0].items())  # the checkpoint, bit for bit
    assert any(not restored[0][k].equal(v) for k, v in saved[1].items())
    rates = {rec["rollout_id"]: rec["train/lr"] for rec in records if rec.get("role") == "actor"}
    assert rates[2] == pytest.approx(0.5 * rates[1]) and rates[1] == rates[0] == 1e-3  # a constant schedule
    assert read_latest(str(tmp_path / "ckpt")) == 2  # the save after the rollback moved the pointer on
