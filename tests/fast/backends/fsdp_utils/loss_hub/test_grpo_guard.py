"""The grpo_guard formula on hand-built pairs: the recompute pass stores μ_old and the old log-prob, after which the
same prediction gives r̂ = 1 and the on-policy loss reweighted by 1/(−dt); a formula without μ_old says how to get it;
its entry takes the ratio keywords."""

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, check_loss_hooks
from miles.backends.fsdp_utils.loss_hub.grpo_guard import guard_formula
from tests.fast.backends.fsdp_utils.loss_hub.policy_pairs import B, call, make_pairs


def test_after_the_recompute_pass_the_ratio_is_one_and_the_loss_is_on_policy():
    pairs = make_pairs()
    velocity = torch.randn(B, 2, 4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    assert call(guard_formula, pairs, velocity.detach(), write_old_log_prob=True)[0] is None
    assert pairs["old_mean"].abs().sum() > 0 and pairs["old_log_prob"].abs().sum() > 0
    loss, metrics = call(guard_formula, pairs, velocity)
    assert metrics["train/ratio_mean"] == 1.0
    adv = torch.tensor([1.0, -2.0, 5.0])  # clamped to ±5
    weight = 1 / torch.tensor([0.1, 0.2, 0.05])  # 1/(−dt)
    assert loss.item() == pytest.approx(-(adv * weight).sum().item(), rel=1e-6)
    loss.backward()
    assert velocity.grad.abs().sum() > 0


def test_pairs_without_the_rollout_means_name_the_missing_column():
    pairs = make_pairs()
    del pairs["old_mean"]
    with pytest.raises(KeyError, match="old_mean.*record_means"):
        call(guard_formula, pairs, torch.zeros(B, 2, 4, 4))


def test_the_entries_take_the_ratio_keywords():
    check_loss_hooks(LOSS_HOOKS[("grpo_guard", "actor")], log_prob_ratio=True)
