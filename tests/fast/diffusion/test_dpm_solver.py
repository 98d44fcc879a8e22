"""MixGRPO-Flash's maths against independent computations: the compressed grid, DPM-Solver++ exact for a constant
x̂₀, and its order on Gaussian data, whose x̂₀ and probability-flow ODE are known in closed form."""

import math

import pytest
import torch

from miles.diffusion.dpm_solver import dpm_solver_pp_step, flash_sigmas


def shifted_grid(num_steps, shift):
    """σ = s·t/(1 + (s − 1)·t) at t = 1 − i/N (diffusers' table differs slightly at the low end; any grid does)."""
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


@pytest.mark.parametrize(
    ("num_steps", "last", "ratio", "n_post"), [(25, 3, 0.4, 8), (25, 22, 0.4, 2), (10, 0, 1.0, 10)]
)
def test_flash_grid_strictly_decreases_to_zero_from_the_windows_last_sigma(num_steps, last, ratio, n_post):
    shift = 3.0
    grid = shifted_grid(num_steps, shift)
    flash = flash_sigmas(grid, last, ratio, shift)
    assert len(flash) == last + 1 + n_post  # n_post = max(int((N − L)·ratio), 2), written out per case
    assert torch.equal(flash[: last + 2], grid[: last + 2])  # the window's σ and its last σ' unchanged
    assert (flash[1:] < flash[:-1]).all() and flash[-1] == 0.0
    post = flash[last + 1 :].double()
    unshifted = post / (shift - (shift - 1) * post)  # uniform in t before the shift σ = s·t/(1 + (s − 1)·t)
    assert torch.allclose(unshifted.diff(), unshifted.diff()[0].expand(n_post - 1), atol=1e-6)


def test_flash_grid_refuses_a_window_that_reaches_the_last_two_steps():
    with pytest.raises(ValueError, match="last two"):
        flash_sigmas(shifted_grid(10, 3.0), 8, 0.4, 3.0)


def test_dpm_solver_is_exact_for_a_constant_denoised_prediction():
    torch.manual_seed(0)
    x0, eps = torch.randn(3, 5), torch.randn(3, 5)
    grid = [0.83, 0.61, 0.37, 0.12, 0.0]
    x, prev = (1 - grid[0]) * x0 + grid[0] * eps, None
    for i in range(len(grid) - 1):
        x = dpm_solver_pp_step(x, x0, grid[i], grid[i + 1], prev_denoised=prev, sigma_prev=grid[i - 1] if i else None)
        prev = x0
        expected = (1 - grid[i + 1]) * x0 + grid[i + 1] * eps  # on the straight path of that x₀ and ε
        assert torch.allclose(x, expected, atol=1e-6)
    assert torch.equal(x, x0)  # the last step (σ' = 0) is x̂₀ itself


# data x₀ ~ N(M, C²) per dim: x_σ ~ N((1−σ)M, s(σ)²) with s² = (1−σ)²C² + σ²; E[x₀ | x_σ] and the ODE in closed form
M, C = 0.5, 0.3


def marginal_std(sigma):
    return math.sqrt((1 - sigma) ** 2 * C**2 + sigma**2)


def posterior_mean(x, sigma):
    return M + (1 - sigma) * C**2 / marginal_std(sigma) ** 2 * (x - (1 - sigma) * M)


def solve(x, grid, *, dpm):
    prev = None
    for i in range(len(grid) - 1):
        denoised = posterior_mean(x, grid[i])
        if dpm:
            previous_sigma = grid[i - 1] if i else None
            x = dpm_solver_pp_step(x, denoised, grid[i], grid[i + 1], prev_denoised=prev, sigma_prev=previous_sigma)
            x = x.double()
        else:  # Euler on v = (x − x̂₀)/σ
            x = x + (x - denoised) / grid[i] * (grid[i + 1] - grid[i])
        prev = denoised
    return x


def test_dpm_solver_is_second_order_on_gaussian_data_and_beats_euler():
    start, end = 0.9, 0.05
    x = torch.linspace(-2.0, 2.0, 9, dtype=torch.float64)
    exact = (1 - end) * M + marginal_std(end) / marginal_std(start) * (x - (1 - start) * M)  # the flow keeps z
    errors = {}
    for steps in (16, 32, 64):
        lam = torch.linspace(math.log((1 - start) / start), math.log((1 - end) / end), steps + 1, dtype=torch.float64)
        grid = torch.sigmoid(-lam).tolist()  # σ = 1/(1 + e^λ), uniform steps h in λ
        errors[steps] = [(solve(x, grid, dpm=dpm) - exact).abs().max().item() for dpm in (True, False)]
    for coarse, fine in ((16, 32), (32, 64)):
        assert errors[coarse][0] < errors[coarse][1] / 10  # beats Euler at the same steps
        assert errors[coarse][0] / errors[fine][0] > 3.2  # ~4x per halving of h: second order
        assert 1.7 < errors[coarse][1] / errors[fine][1] < 2.3  # Euler: ~2x, first order
