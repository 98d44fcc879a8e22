"""The policy_loss (Flow-GRPO) formula on hand-built pairs: the recompute pass stores the old log-prob, after which
the same prediction gives ratio 1, no clipping and the on-policy loss −ΣA (advantages clamped); window 0 measures the
log-prob gap to the rollout; the KL to `ref` joins the loss."""

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, check_loss_hooks
from miles.backends.fsdp_utils.loss_hub.flow_grpo import policy_formula
from tests.fast.backends.fsdp_utils.loss_hub.policy_pairs import B, call, make_ctx, make_pairs


def velocity(seed=1, grad=False):
    return torch.randn(B, 2, 4, 4, generator=torch.Generator().manual_seed(seed), requires_grad=grad)


def test_after_the_recompute_pass_the_ratio_is_one_and_the_loss_is_minus_the_clamped_advantages():
    pairs = make_pairs()
    v = velocity(grad=True)
    assert call(policy_formula, pairs, v.detach(), write_old_log_prob=True)[0] is None
    assert pairs["old_log_prob"].abs().sum() > 0
    loss, metrics = call(policy_formula, pairs, v)
    assert metrics["train/ratio_mean"] == 1.0 and metrics["train/clipfrac"] == 0.0
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 5.0), rel=1e-6)  # A = 7 clamped to 5
    assert "train/log_prob_abs_diff" not in metrics  # window 1: after an update
    loss.backward()
    assert v.grad.abs().sum() > 0


def test_window_0_measures_the_gap_to_the_rollouts_log_prob():
    pairs = make_pairs()
    _, metrics = call(policy_formula, pairs, velocity(), optim_step_idx=0, old_log_prob_from_new=True)
    assert metrics["train/ratio_mean"] == 1.0 and metrics["train/log_prob_abs_diff"] > 0  # rollout_log_prob is 0


def test_the_kl_to_ref_joins_the_loss_with_its_weight():
    pairs, v = make_pairs(), velocity()
    plain, _ = call(policy_formula, pairs, v, old_log_prob_from_new=True)
    ctx = make_ctx(diffusion_kl_beta=0.5)
    with_kl, metrics = call(
        policy_formula, pairs, v, ctx=ctx, frozen_preds={"ref": velocity(2)}, old_log_prob_from_new=True
    )
    assert with_kl.item() - plain.item() == pytest.approx(0.5 * B * metrics["train/kl"], rel=1e-4)
    assert metrics["train/loss"] == pytest.approx(with_kl.item() / B, rel=1e-5)


def test_the_entry_takes_the_ratio_keywords():
    check_loss_hooks(LOSS_HOOKS[("policy_loss", "actor")], log_prob_ratio=True)
