"""Group-relative advantages against a plain per-group loop."""

from __future__ import annotations

import statistics

import pytest
import torch

from miles.rollout.advantages import compute_grpo_advantages


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
