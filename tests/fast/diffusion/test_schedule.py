"""Sigma grids, timestep densities, weightings and the flow-matching loss against independent computations."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from miles.diffusion.schedule import (
    add_noise,
    flow_matching_loss,
    loss_weighting,
    sample_timestep_density,
    sampling_sigmas,
    sigmas_from_u,
    training_sigmas,
)


def test_sampling_sigmas_are_the_scheduler_table():
    sigmas = sampling_sigmas(10, shift=3.0)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    assert sigmas.shape == (11,)
    assert sigmas.dtype == torch.float32
    torch.testing.assert_close(sigmas, scheduler.sigmas.float())
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert sigmas[-2].item() == pytest.approx(0.0089, abs=5e-4)
    # A naive one-shift grid would end near 0.27 before zero: the scheduler's double shift must survive.
    naive = 3 * 0.1 / (1 + 2 * 0.1)
    assert abs(sigmas[-2].item() - naive) > 0.1


def test_training_sigmas_are_the_shifted_training_table():
    table = training_sigmas(shift=3.0)
    assert table.shape == (1000,)
    u = torch.arange(1000, 0, -1, dtype=torch.float64) / 1000
    expected = 3 * u / (1 + 2 * u)
    torch.testing.assert_close(table.double(), expected, atol=1e-6, rtol=0)


def test_logit_normal_density_matches_quantiles():
    g = torch.Generator().manual_seed(0)
    u = sample_timestep_density("logit_normal", 200_000, generator=g)
    assert u.min() >= 0 and u.max() <= 1
    normal = torch.distributions.Normal(0.0, 1.0)
    probs = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
    expected = torch.sigmoid(normal.icdf(probs))
    empirical = torch.quantile(u, probs)
    torch.testing.assert_close(empirical, expected, atol=5e-3, rtol=0)
    # KS statistic against the logit-normal CDF, Phi(logit(u)).
    sorted_u, _ = torch.sort(u.double())
    cdf = normal.cdf(torch.logit(sorted_u).float()).double()
    ecdf = torch.arange(1, len(u) + 1, dtype=torch.float64) / len(u)
    assert (cdf - ecdf).abs().max() < 1.36 / math.sqrt(len(u)) * 1.5


def test_logit_normal_respects_mean_and_std():
    g = torch.Generator().manual_seed(1)
    u = sample_timestep_density("logit_normal", 100_000, logit_mean=0.5, logit_std=2.0, generator=g)
    z = torch.logit(u.double())
    assert z.mean().item() == pytest.approx(0.5, abs=0.03)
    assert z.std().item() == pytest.approx(2.0, abs=0.03)


def test_uniform_and_mode_densities():
    g = torch.Generator().manual_seed(2)
    u = sample_timestep_density("uniform", 100_000, generator=g)
    assert u.mean().item() == pytest.approx(0.5, abs=0.01)
    g = torch.Generator().manual_seed(3)
    m = sample_timestep_density("mode", 10, mode_scale=1.29, generator=g)
    g = torch.Generator().manual_seed(3)
    raw = torch.rand(10, generator=g)
    expected = [1 - x - 1.29 * (math.cos(math.pi * x / 2) ** 2 - 1 + x) for x in raw.tolist()]
    torch.testing.assert_close(m, torch.tensor(expected))
    assert m.min() >= 0 and m.max() <= 1


def test_unknown_density_names_the_valid_ones():
    with pytest.raises(ValueError, match="logit_normal"):
        sample_timestep_density("gaussian", 4)


def test_sigmas_from_u_indexes_like_the_sd3_script():
    table = torch.tensor([1.0, 0.75, 0.5, 0.25])
    u = torch.tensor([0.0, 0.24, 0.25, 0.6, 0.99, 1.0])
    torch.testing.assert_close(sigmas_from_u(u, table), torch.tensor([1.0, 1.0, 0.75, 0.5, 0.25, 0.25]))


def test_loss_weighting_values():
    sigmas = torch.tensor([0.25, 0.5, 1.0])
    torch.testing.assert_close(loss_weighting("none", sigmas), torch.ones(3))
    torch.testing.assert_close(loss_weighting("sigma_sqrt", sigmas), torch.tensor([16.0, 4.0, 1.0]))
    expected = [2 / (math.pi * (1 - 2 * s + 2 * s * s)) for s in (0.25, 0.5, 1.0)]
    torch.testing.assert_close(loss_weighting("cosmap", sigmas), torch.tensor(expected))
    with pytest.raises(ValueError, match="cosmap"):
        loss_weighting("bogus", sigmas)


def test_add_noise_interpolates_per_sample():
    x0 = torch.randn(2, 3, 4)
    eps = torch.randn(2, 3, 4)
    out = add_noise(x0, eps, torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(out[0], x0[0])
    torch.testing.assert_close(out[1], eps[1])
    torch.testing.assert_close(add_noise(x0, eps, 0.3), 0.7 * x0 + 0.3 * eps)


def test_flow_matching_loss_zero_at_the_target():
    x0, eps = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    loss = flow_matching_loss(eps - x0, x0, eps, torch.tensor([0.1, 0.5, 0.9]), weighting="sigma_sqrt")
    assert loss.shape == (3,)
    torch.testing.assert_close(loss, torch.zeros(3))


def test_flow_matching_loss_gradient_matches_hand_written_reference():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 6)
    x0, eps = torch.randn(4, 6), torch.randn(4, 6)
    sigmas = torch.tensor([0.2, 0.4, 0.6, 0.8])
    x_t = add_noise(x0, eps, sigmas)
    flow_matching_loss(model(x_t), x0, eps, sigmas, weighting="sigma_sqrt").mean().backward()

    # d/dW of mean_b mean_d w_b (W x_b + c − y_b)² = Σ_b (2 w_b / (B·D)) e_b x_bᵀ.
    B, D = 4, 6
    with torch.no_grad():
        x_ref = (1 - sigmas[:, None]) * x0 + sigmas[:, None] * eps
        err = x_ref @ model.weight.T + model.bias - (eps - x0)
        w = 1 / sigmas**2
        coeff = 2 * w[:, None] * err / (B * D)
        grad_w = coeff.T @ x_ref
        grad_b = coeff.sum(0)
    torch.testing.assert_close(model.weight.grad, grad_w)
    torch.testing.assert_close(model.bias.grad, grad_b)


def test_flow_matching_loss_is_float32_for_bf16_inputs():
    x0 = torch.randn(2, 4).bfloat16()
    loss = flow_matching_loss(torch.zeros(2, 4).bfloat16(), x0, torch.zeros(2, 4).bfloat16(), 0.5)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, (x0.float() ** 2).mean(1))
