"""Step kernels: log-probs against torch.distributions, Euler limit, marginal preservation, CPS coefficients, the
DanceGRPO kernel."""

from __future__ import annotations

import math

import pytest
import torch

from miles.diffusion.schedule import sampling_sigmas
from miles.diffusion.sde import (
    SDE_KERNELS,
    cps_step,
    dance_step,
    get_sde_kernel,
    kl_to_reference,
    ode_step,
    renoise_sigmas,
    renoise_step,
    sde_step,
)


def _gaussian_velocity(x: torch.Tensor, sigma: float, m: float, s: float) -> torch.Tensor:
    """Exact v(x, σ) = E[ε − x₀ | x_σ = x] for x₀ ~ N(m, s²): both are linear in x for jointly Gaussian data."""
    var = (1 - sigma) ** 2 * s**2 + sigma**2
    centred = x - (1 - sigma) * m
    e_x0 = m + (1 - sigma) * s**2 / var * centred
    e_eps = sigma / var * centred
    return e_eps - e_x0


def test_sde_log_prob_equals_independent_normal_density():
    torch.manual_seed(0)
    x, v, x_next = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    sigma, sigma_next, a = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.45, 0.1]), 0.7
    out = sde_step(x, v, sigma, sigma_next, noise_level=a, sigma_max=0.96, prev_sample=x_next)
    for b in range(3):
        s, sn = sigma[b].item(), sigma_next[b].item()
        dt = sn - s
        std_t = a * math.sqrt(s / (1 - s))
        mu = x[b] * (1 + std_t**2 * dt / (2 * s)) + v[b] * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        std = std_t * math.sqrt(-dt)
        expected = torch.distributions.Normal(mu, std).log_prob(x_next[b]).mean()
        torch.testing.assert_close(out.log_prob[b], expected)
        assert out.std_t[b].item() == pytest.approx(std_t, rel=1e-5)
        assert out.step_std[b].item() == pytest.approx(std, rel=1e-5)
    torch.testing.assert_close(out.next_latents, x_next)


def test_sde_sample_is_mean_plus_scaled_noise():
    x, v, z = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)
    out = sde_step(x, v, 0.5, 0.4, noise_level=0.7, sigma_max=0.96, noise=z)
    torch.testing.assert_close(out.next_latents, out.mean + out.step_std[:, None] * z)


def test_noise_level_zero_gives_euler():
    x, v = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    sigma, sigma_next = torch.tensor([0.7, 0.5]), torch.tensor([0.6, 0.2])
    out = sde_step(x, v, sigma, sigma_next, noise_level=0.0, sigma_max=0.96)
    euler = x + v * (sigma_next - sigma)[:, None, None]
    torch.testing.assert_close(out.next_latents, euler)
    ode = ode_step(x, v, sigma, sigma_next)
    torch.testing.assert_close(ode.next_latents, euler)
    assert ode.log_prob is None


def test_sigma_one_uses_sigma_max():
    grid = sampling_sigmas(10)
    x, v, x_next = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)
    # 1 − 1e-7 must also count as 1 (tolerance, not ==); in float32 it rounds to 1 − 6e-8.
    sigma = torch.tensor([1.0, 1.0 - 1e-7])
    out = sde_step(x, v, sigma, grid[1], noise_level=0.7, sigma_max=grid[1].item(), prev_sample=x_next)
    expected = 0.7 * math.sqrt(1.0 / (1 - grid[1].item()))
    assert torch.isfinite(out.std_t).all() and torch.isfinite(out.log_prob).all()
    torch.testing.assert_close(out.std_t, torch.full((2,), expected), rtol=1e-4, atol=0)


def test_sde_preserves_gaussian_marginals():
    m, s, n_steps = 0.5, 0.3, 100
    g = torch.Generator().manual_seed(0)
    sigmas = torch.linspace(1.0, 0.0, n_steps + 1)
    x = torch.randn(20_000, 1, generator=g)
    for i in range(n_steps):
        sigma, sigma_next = sigmas[i].item(), sigmas[i + 1].item()
        v = _gaussian_velocity(x, sigma, m, s)
        x = sde_step(x, v, sigma, sigma_next, noise_level=0.7, sigma_max=sigmas[1].item(), generator=g).next_latents
    assert x.mean().item() == pytest.approx(m, abs=0.015)
    assert x.std().item() == pytest.approx(s, abs=0.015)


def test_cps_preserves_coefficients_given_the_true_velocity():
    # With v = ε − x₀ exactly, x' − (1 − σ')·x₀ must be pure noise of std σ' (the kernel's namesake property).
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(1, 50_000, generator=g).expand(2, -1)
    eps = torch.randn(2, 50_000, generator=g)
    sigma, sigma_next = torch.tensor([0.8, 0.3]), torch.tensor([0.6, 0.1])
    x = (1 - sigma[:, None]) * x0 + sigma[:, None] * eps
    out = cps_step(x, eps - x0, sigma, sigma_next, noise_level=0.7, sigma_max=1.0, generator=g)
    residual = out.next_latents - (1 - sigma_next[:, None]) * x0
    torch.testing.assert_close(residual.std(dim=1), sigma_next, atol=0.01, rtol=0)
    assert residual.mean(dim=1).abs().max() < 0.01


def test_cps_coefficients_by_hand():
    x, v, x_next = torch.randn(1, 6), torch.randn(1, 6), torch.randn(1, 6)
    sigma, sigma_next, a = 0.6, 0.4, 0.7
    out = cps_step(x, v, sigma, sigma_next, noise_level=a, sigma_max=1.0, prev_sample=x_next)
    std = sigma_next * math.sin(a * math.pi / 2)
    x0_hat = x - sigma * v
    eps_hat = x + (1 - sigma) * v
    mu = (1 - sigma_next) * x0_hat + math.sqrt(sigma_next**2 - std**2) * eps_hat
    torch.testing.assert_close(out.mean, mu)
    assert out.step_std.item() == pytest.approx(std, rel=1e-6)
    assert out.std_t.item() == pytest.approx(std, rel=1e-6)
    torch.testing.assert_close(out.log_prob, -((x_next - mu) ** 2).mean(dim=1))


@pytest.mark.parametrize("name", sorted(SDE_KERNELS))
def test_outputs_are_float32_for_bf16_inputs(name):
    x, v = torch.randn(2, 4).bfloat16(), torch.randn(2, 4).bfloat16()
    out = get_sde_kernel(name)(x, v, torch.tensor([0.5, 0.5]).bfloat16(), 0.4, noise_level=0.7, sigma_max=0.96)
    assert out.next_latents.dtype == torch.float32
    assert out.mean.dtype == torch.float32
    assert out.std_t.dtype == torch.float32
    if out.log_prob is not None:
        assert out.log_prob.dtype == torch.float32


def test_log_prob_is_a_mean_not_a_sum_over_dims():
    x, v = torch.randn(2, 4, 64, 64), torch.randn(2, 4, 64, 64)
    out = sde_step(x, v, 0.5, 0.4, noise_level=0.7, sigma_max=0.96, generator=torch.Generator().manual_seed(0))
    # A Gaussian sample's mean log-density is about −log s − ½log 2π − ½, not 16k times that.
    expected = -torch.log(out.step_std) - 0.5 * math.log(2 * math.pi) - 0.5
    torch.testing.assert_close(out.log_prob, expected, atol=0.05, rtol=0)


def test_unknown_kernel_lists_valid_names():
    with pytest.raises(ValueError, match="cps, dance, ode, renoise, sde"):
        get_sde_kernel("ddim")


def test_kl_is_zero_for_equal_means_and_matches_formula():
    mean, std = torch.randn(3, 2, 4), torch.tensor([0.5, 1.0, 2.0])
    torch.testing.assert_close(kl_to_reference(mean, mean.clone(), std), torch.zeros(3))
    ref = mean + 0.1
    torch.testing.assert_close(kl_to_reference(mean, ref, std), 0.01 / (2 * std**2))


def test_renoise_step_renoises_the_x0_prediction_and_ends_clean():
    x, v, eps = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    sigma = torch.tensor([1.0, 0.75])
    out = renoise_step(x, v, sigma, 0.5, noise=eps)
    x0_hat = x - sigma[:, None] * v
    torch.testing.assert_close(out.mean, x0_hat)
    torch.testing.assert_close(out.next_latents, 0.5 * x0_hat + 0.5 * eps)
    assert out.log_prob is None
    last = renoise_step(x, v, sigma, 0.0, noise=eps)
    torch.testing.assert_close(last.next_latents, x0_hat)


def test_renoise_grid_is_uniform_in_u_then_shifted():
    torch.testing.assert_close(renoise_sigmas(4, shift=1.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    torch.testing.assert_close(renoise_sigmas(1, shift=3.0), torch.tensor([1.0, 0.0]))
    grid = renoise_sigmas(2, shift=3.0)
    assert grid[1].item() == pytest.approx(3 * 0.5 / (1 + 2 * 0.5))


def test_dance_mean_is_the_sde_mean_with_std_t_eta():
    # at σ the sde kernel's std_t is a·√(σ/(1 − σ)): with a = η·√((1 − σ)/σ) both kernels have std_t = η
    torch.manual_seed(1)
    x, v = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    sigma, sigma_next, eta = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.45, 0.1]), 0.3
    out = dance_step(x, v, sigma, sigma_next, noise_level=eta, generator=torch.Generator().manual_seed(0))
    for b in range(3):
        s = sigma[b].item()
        a = eta * math.sqrt((1 - s) / s)
        ref = sde_step(x[b : b + 1], v[b : b + 1], s, sigma_next[b].item(), noise_level=a, sigma_max=0.96)
        assert ref.std_t.item() == pytest.approx(eta, rel=1e-6)
        torch.testing.assert_close(out.mean[b : b + 1], ref.mean)
    assert torch.equal(out.std_t, torch.full((3,), eta))
    torch.testing.assert_close(out.step_std, eta * torch.sqrt(sigma - sigma_next))


def test_dance_log_prob_is_the_gaussian_written_out():
    torch.manual_seed(2)
    x, v, x_next = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    sigma, sigma_next, eta = torch.tensor([1.0, 0.5]), torch.tensor([0.9, 0.3]), 0.3  # σ = 1 needs no σ̃ here
    out = dance_step(x, v, sigma, sigma_next, noise_level=eta, prev_sample=x_next)
    for b in range(2):
        s, sn = sigma[b].item(), sigma_next[b].item()
        dt = sn - s
        mu = x[b] * (1 + eta**2 * dt / (2 * s)) + v[b] * (1 + eta**2 * (1 - s) / (2 * s)) * dt
        std = eta * math.sqrt(-dt)
        density = -((x_next[b] - mu) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
        torch.testing.assert_close(out.mean[b], mu)
        assert out.log_prob[b].item() == pytest.approx(density.mean().item(), rel=1e-5)
    assert torch.equal(out.next_latents, x_next)
