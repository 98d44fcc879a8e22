"""DMD2: the distribution-matching gradient, its generator loss, the critic loss and the timestep draw."""

from __future__ import annotations

import pytest
import torch

from miles.diffusion.dmd import critic_loss, dmd_gradient, generator_loss, sample_dmd_timesteps, x0_from_velocity


def test_gradient_is_zero_when_fake_equals_real():
    x, real = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    torch.testing.assert_close(dmd_gradient(x, real.clone(), real), torch.zeros(2, 3, 4))


def test_gradient_matches_per_sample_formula_and_samples_are_independent():
    x, fake, real = torch.randn(3, 2, 5), torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    g = dmd_gradient(x, fake, real)
    for b in range(3):
        expected = (fake[b].double() - real[b].double()) / (x[b].double() - real[b].double()).abs().mean()
        torch.testing.assert_close(g[b], expected.float())
    real_bad = real.clone()
    real_bad[1] += 100.0
    g_bad = dmd_gradient(x, fake, real_bad)
    torch.testing.assert_close(g_bad[0], g[0])
    torch.testing.assert_close(g_bad[2], g[2])


def test_gradient_nan_to_num_when_real_equals_x():
    x = torch.randn(2, 4)
    g = dmd_gradient(x, x + 1.0, x.clone())
    assert torch.isfinite(g).all()


def test_generator_loss_gradient_is_g_over_numel():
    x, fake, real = torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    g = dmd_gradient(x, fake, real)
    x_theta = x.clone().requires_grad_()
    generator_loss(x_theta, x - g).backward()
    torch.testing.assert_close(x_theta.grad, g / x.numel())
    per_sample = generator_loss(x, x - g, reduction="none")
    torch.testing.assert_close(per_sample, 0.5 * (g**2).reshape(2, -1).mean(1))


def test_critic_loss_zero_for_perfect_prediction():
    x, eps = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    torch.testing.assert_close(critic_loss(eps - x, eps, x), torch.zeros(2))
    torch.testing.assert_close(critic_loss(eps - x + 1.0, eps, x), torch.ones(2))


def test_x0_from_velocity_inverts_the_interpolation():
    x0, eps, sigma = torch.randn(2, 3), torch.randn(2, 3), torch.tensor([0.2, 0.9])
    x_t = (1 - sigma[:, None]) * x0 + sigma[:, None] * eps
    torch.testing.assert_close(x0_from_velocity(x_t, eps - x0, sigma), x0)


def test_dmd_timesteps_are_shifted_and_clamped():
    g = torch.Generator().manual_seed(0)
    sigma = sample_dmd_timesteps(50_000, shift=3.0, generator=g)
    assert sigma.min() >= 0.02 and sigma.max() <= 0.98
    g = torch.Generator().manual_seed(0)
    u = torch.rand(50_000, generator=g)
    torch.testing.assert_close(sigma, (3 * u / (1 + 2 * u)).clamp(0.02, 0.98))
    # Shift 3 pushes mass towards noise: P(σ > 0.5) = P(u > 0.25) = 0.75.
    assert (sigma > 0.5).float().mean().item() == pytest.approx(0.75, abs=0.01)
