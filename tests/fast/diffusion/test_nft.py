"""DiffusionNFT: r mapping, gradient symmetry at θ = θ_old, reduction to weighted flow matching."""

from __future__ import annotations

import pytest
import torch

from miles.diffusion.nft import advantage_to_r, nft_loss


def test_r_mapping():
    r = advantage_to_r(torch.tensor([0.0, -5.0, 5.0, -9.0, 12.0, 2.5]), adv_clip_max=5.0)
    torch.testing.assert_close(r, torch.tensor([0.5, 0.0, 1.0, 0.0, 1.0, 0.75]))


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    t = torch.tensor([0.3, 0.6, 0.9])
    x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * eps
    v_old = torch.randn(3, 2, 4, generator=g)
    return x0, eps, t, x_t, v_old


def _grad_at_old(r: torch.Tensor, beta: float) -> torch.Tensor:
    x0, _, t, x_t, v_old = _setup()
    v_theta = v_old.clone().requires_grad_()
    loss, _ = nft_loss(v_theta, v_old, x0, x_t, t, r, beta=beta, adv_clip_max=5.0)
    loss.sum().backward()
    return v_theta.grad


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_gradient_at_old_policy_is_zero_for_half_and_flips_under_one_minus_r(beta):
    torch.testing.assert_close(_grad_at_old(torch.full((3,), 0.5), beta), torch.zeros(3, 2, 4))
    r = torch.tensor([0.9, 0.2, 0.7])
    g = _grad_at_old(r, beta)
    assert g.abs().max() > 1e-3
    torch.testing.assert_close(_grad_at_old(1 - r, beta), -g)


def test_r_one_beta_one_is_weighted_flow_matching():
    x0, eps, t, x_t, _ = _setup(1)
    g = torch.Generator().manual_seed(5)
    v_theta, v_old = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    loss, _ = nft_loss(v_theta, v_old, x0, x_t, t, torch.ones(3), beta=1.0, adv_clip_max=5.0)
    for b in range(3):
        err = v_theta[b].double() - (eps[b].double() - x0[b].double())
        w = (t[b].double() * err.abs()).mean()
        expected = 5.0 * t[b].double() ** 2 * (err**2).mean() / w
        assert loss[b].item() == pytest.approx(expected.item(), rel=1e-5)


def test_weight_floor_and_no_adaptive_weight():
    x0, _, t, x_t, _ = _setup(2)
    v_exact = (x_t - x0) / t[:, None, None]
    loss, metrics = nft_loss(v_exact, v_exact, x0, x_t, t, torch.ones(3), beta=1.0, adv_clip_max=5.0)
    assert torch.isfinite(loss).all()
    assert metrics["weight_pos"].item() == pytest.approx(1e-5)
    v = v_exact + 1.0
    plain, _ = nft_loss(v, v_exact, x0, x_t, t, torch.ones(3), beta=0.5, adv_clip_max=5.0, adaptive_weight=False)
    # x̂₀⁺ − x₀ = −t·β·1 everywhere, so mean square = (tβ)²; times c / β.
    torch.testing.assert_close(plain, 5.0 * (t * 0.5) ** 2 / 0.5)
