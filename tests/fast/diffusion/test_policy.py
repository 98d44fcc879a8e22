"""Clipped policy loss: value at ratio 1, where clipping kills the gradient, metrics, advantage clamp."""

from __future__ import annotations

import pytest
import torch

from miles.diffusion.policy import clipped_policy_loss


def test_ratio_is_one_and_loss_is_minus_mean_advantage_before_first_update():
    logp = torch.randn(6)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0, -0.1, 0.0])
    loss, metrics = clipped_policy_loss(logp, logp.clone(), adv, clip_range=1e-4, adv_clip_max=5.0)
    torch.testing.assert_close(loss.mean(), -adv.mean())
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert metrics["clipfrac"].item() == 0.0
    assert metrics["approx_kl"].item() == 0.0


@pytest.mark.parametrize(
    ("adv", "log_ratio", "clipped"),
    [
        (1.0, 0.5, True),  # A > 0, ratio > 1 + ε
        (-1.0, -0.5, True),  # A < 0, ratio < 1 − ε
        (1.0, -0.5, False),  # A > 0, ratio below the band: unclipped branch is the max
        (-1.0, 0.5, False),  # A < 0, ratio above the band
        (1.0, 0.05, False),  # inside the band
    ],
)
def test_clipping_zeroes_the_gradient_where_it_should(adv, log_ratio, clipped):
    old = torch.tensor([0.3])
    logp = (old + log_ratio).requires_grad_()
    loss, _ = clipped_policy_loss(logp, old, torch.tensor([adv]), clip_range=0.2, adv_clip_max=5.0)
    loss.sum().backward()
    expected = 0.0 if clipped else -adv * torch.exp(torch.tensor(log_ratio)).item()
    assert logp.grad.item() == pytest.approx(expected, abs=1e-6)


def test_metrics_match_hand_computation():
    old = torch.zeros(4)
    logp = torch.tensor([0.0, 0.1, -0.3, 0.02])
    _, metrics = clipped_policy_loss(logp, old, torch.ones(4), clip_range=0.05, adv_clip_max=5.0)
    ratios = [1.0, 1.1051709, 0.7408182, 1.0202013]
    assert metrics["ratio_mean"].item() == pytest.approx(sum(ratios) / 4, rel=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    assert metrics["approx_kl"].item() == pytest.approx(0.5 * (0.01 + 0.09 + 0.0004) / 4, rel=1e-5)


def test_advantages_are_clamped():
    logp = torch.zeros(2)
    loss, _ = clipped_policy_loss(logp, logp, torch.tensor([10.0, -8.0]), clip_range=1e-4, adv_clip_max=5.0)
    torch.testing.assert_close(loss, torch.tensor([-5.0, 5.0]))
