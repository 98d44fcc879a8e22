"""Flow-DPPO's Gaussian KL and its trust-region mask against written-out computations (ALGORITHMS.md "Flow-DPPO")."""

from __future__ import annotations

import math

import pytest
import torch

from miles.diffusion.dppo import gaussian_mean_kl, kl_masked_policy_loss


def test_kl_is_the_exact_gaussian_kl_per_element():
    g = torch.Generator().manual_seed(0)
    mean, old = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    s = torch.tensor([0.3, 0.05, 0.01])
    p = torch.distributions.Normal(mean, s.reshape(-1, 1, 1, 1))
    q = torch.distributions.Normal(old, s.reshape(-1, 1, 1, 1))
    expected = torch.distributions.kl_divergence(p, q).reshape(3, -1).mean(dim=1)
    torch.testing.assert_close(gaussian_mean_kl(mean, old, s), expected, rtol=1e-5, atol=0)
    assert torch.equal(gaussian_mean_kl(mean, mean.clone(), s), torch.zeros(3))


def gradients(log_ratio, adv, kl, threshold=1e-5):
    log_prob = torch.tensor(log_ratio, dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(log_prob)
    loss, ratio, keep = kl_masked_policy_loss(
        log_prob,
        old,
        torch.tensor(kl, dtype=torch.float64),
        torch.tensor(adv),
        kl_threshold=threshold,
        adv_clip_max=5.0,
    )
    loss.sum().backward()
    return loss.detach(), log_prob.grad, keep


def test_inside_the_trust_region_it_is_the_plain_ratio_gradient():
    log_ratio, adv = [0.3, -0.2, 0.1, -0.4], [1.0, 2.0, -1.5, -0.5]
    loss, grad, keep = gradients(log_ratio, adv, [0.0, 5e-6, 9.9e-6, 1e-7])
    assert keep.all()
    # −A·r and its gradient −A·r w.r.t. log-prob, written out
    expected = torch.tensor([-a * math.exp(lr) for lr, a in zip(log_ratio, adv)], dtype=torch.float64)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected)


def test_outside_and_moving_away_is_dropped_and_moving_back_is_kept():
    # r > 1 with A > 0 and r < 1 with A < 0 move away; r < 1 with A > 0 and r > 1 with A < 0 move back
    log_ratio, adv = [0.3, -0.3, -0.3, 0.3], [1.0, -1.0, 1.0, -1.0]
    loss, grad, keep = gradients(log_ratio, adv, [2e-5] * 4)
    assert keep.tolist() == [False, False, True, True]
    assert loss[:2].tolist() == [0.0, 0.0] and grad[:2].tolist() == [0.0, 0.0]
    for i in (2, 3):
        assert grad[i].item() == pytest.approx(-adv[i] * math.exp(log_ratio[i]), rel=1e-12)
        assert loss[i].item() == pytest.approx(-adv[i] * math.exp(log_ratio[i]), rel=1e-12)


def test_the_threshold_itself_is_outside_and_an_overflowed_dropped_ratio_gives_no_nan():
    loss, grad, keep = gradients([1000.0, 1e-3], [1.0, 1.0], [1.0, 1e-5])
    assert keep.tolist() == [False, False]  # KL >= δ counts as outside, as in both peer implementations
    assert loss.tolist() == [0.0, 0.0] and grad.tolist() == [0.0, 0.0]


def test_advantages_are_clamped():
    loss, _, _ = gradients([0.0, 0.0], [9.0, -7.0], [0.0, 0.0])
    assert loss.tolist() == [-5.0, 5.0]
