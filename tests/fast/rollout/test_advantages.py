"""Group-relative advantages against a plain per-group loop, and with several rewards each normalised in its group."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from miles.rollout.advantages import compute_grpo_advantages, per_reward_group_advantages


def test_per_group_normalisation_matches_a_loop():
    rewards = torch.tensor([1.0, 2.0, 4.0, 0.5, 0.0, 3.0, 3.0, 1.0])
    adv = compute_grpo_advantages(rewards, 4)
    for start in (0, 4):
        group = rewards[start : start + 4].tolist()
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        expected = [(r - mean) / (std + 1e-4) for r in group]
        torch.testing.assert_close(adv[start : start + 4], torch.tensor(expected))
        assert abs(adv[start : start + 4].sum().item()) < 1e-5


def test_globalize_uses_the_batch_std_and_group_mean():
    rewards = torch.tensor([1.0, 2.0, 4.0, 10.0, 0.0, 30.0])
    adv = compute_grpo_advantages(rewards, 3, globalize_std=True)
    std = statistics.pstdev(rewards.tolist())
    expected = []
    for start in (0, 3):
        group = rewards[start : start + 3].tolist()
        expected += [(r - statistics.fmean(group)) / (std + 1e-4) for r in group]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_zero_spread_group_gives_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.5])
    for globalize in (False, True):
        adv = compute_grpo_advantages(rewards, 3, globalize_std=globalize)
        assert adv[:3].tolist() == [0.0, 0.0, 0.0]
        assert adv[3:].abs().sum() > 0


def test_group_size_one_is_zero_and_finite():
    adv = compute_grpo_advantages(torch.tensor([0.3, 1.0, -2.0]), 1)
    assert adv.tolist() == [0.0, 0.0, 0.0]
    assert compute_grpo_advantages(torch.tensor([0.3, 1.0]), 1, globalize_std=True).tolist() == [0.0, 0.0]


def test_without_std_normalisation_is_centred_rewards():
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])
    torch.testing.assert_close(
        compute_grpo_advantages(rewards, 2, normalize_std=False), torch.tensor([-1.0, 1.0, -2.0, 2.0])
    )


def test_indivisible_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="groups of 4"):
        compute_grpo_advantages(torch.zeros(6), 4)


# ---- several rewards, each normalised within its group (--per-reward-group-norm) ------------------------------------
def grpo_by_hand(values: list[float], group_size: int) -> list[float]:
    out = []
    for start in range(0, len(values), group_size):
        group = values[start : start + group_size]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        out += [0.0 if max(group) == min(group) else (r - mean) / (std + 1e-4) for r in group]
    return out


def test_per_reward_normalisation_weights_each_rewards_own_group_advantage():
    small = [0.0, 1.0, 2.0, 1.0, 1.0, 1.0]  # the second group has no spread in this reward
    large = [100.0, 300.0, 200.0, 0.0, 50.0, 100.0]
    terms = {"small": torch.tensor(small), "large": torch.tensor(large)}
    adv = per_reward_group_advantages(terms, {"small": 1.0, "large": 0.5}, 3)
    # group 1: small -> (r - 1) / (sqrt(2/3) + 1e-4), large -> (r - 200) / (sqrt(20000/3) + 1e-4);
    # group 2: large only, (r - 50) / (sqrt(5000/3) + 1e-4)
    s1, s2, s3 = math.sqrt(2 / 3) + 1e-4, math.sqrt(20000 / 3) + 1e-4, math.sqrt(5000 / 3) + 1e-4
    expected = [-1 / s1 - 0.5 * 100 / s2, 0.5 * 100 / s2, 1 / s1, -0.5 * 50 / s3, 0.0, 0.5 * 50 / s3]
    torch.testing.assert_close(adv, torch.tensor(expected))
    by_hand = [a + 0.5 * b for a, b in zip(grpo_by_hand(small, 3), grpo_by_hand(large, 3))]
    torch.testing.assert_close(adv, torch.tensor(by_hand))
    # the large reward no longer decides the order: best is sample 2 (small's best), not sample 1 (large's best)
    summed = compute_grpo_advantages(torch.tensor([a + 0.5 * b for a, b in zip(small, large)]), 3)
    assert int(summed[:3].argmax()) == 1 and int(adv[:3].argmax()) == 2


def test_per_reward_normalisation_ignores_each_rewards_scale_and_is_linear_without_std():
    small, large = torch.tensor([0.0, 1.0, 3.0, 2.0]), torch.tensor([5.0, 1.0, 2.0, 9.0])
    weights = {"small": 2.0, "large": -1.0}
    base = per_reward_group_advantages({"small": small, "large": large}, weights, 2)
    scaled = per_reward_group_advantages({"small": small * 0.1, "large": large * 1e3}, weights, 2)
    torch.testing.assert_close(scaled, base, atol=0.01, rtol=0)  # only eps (1e-4 against std) sees the scale
    one = per_reward_group_advantages({"small": small}, {"small": 3.0}, 2)
    torch.testing.assert_close(one, 3.0 * compute_grpo_advantages(small, 2))
    centred = per_reward_group_advantages({"small": small, "large": large}, weights, 2, normalize_std=False)
    torch.testing.assert_close(centred, compute_grpo_advantages(2 * small - large, 2, normalize_std=False))
    with pytest.raises(ValueError, match=r"reward terms \['small'\] do not match the weighted rewards"):
        per_reward_group_advantages({"small": small}, weights, 2)
