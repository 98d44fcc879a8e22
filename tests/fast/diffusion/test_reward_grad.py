"""The reward-gradient maths against hand computations (ALGORITHMS.md, "Reward gradients"): ReFL's gradient on a
linear toy, DRaFT-K's gradient confined to the last K steps and equal to the hand derivative of v = a·x, Direct-Align's
exact x̂₀ recovery and its two derivatives, LV's copies, the hinge and the relative reward."""

import pytest
import torch

from miles.diffusion.reward_grad import (
    DENOISE,
    INVERSION,
    direct_align_input,
    direct_align_x0,
    euler_unroll,
    lv_copies,
    one_step_x0,
    relative_reward,
    reward_objective,
    velocity_penalty,
)

GRID = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.1, 0.0], dtype=torch.float64)  # N = 5 steps


def test_refl_gradient_on_a_linear_toy_equals_the_hand_derivative():
    """v = Wx + b, R = wᵀx̂₀, L = λ·ReLU(c − R) with the hinge active: ∂L/∂W = λ·σ_j·w·xᵀ; none once R ≥ c."""
    torch.manual_seed(0)
    d, lam, sigma = 4, 1e-3, 0.3
    W = torch.randn(d, d, dtype=torch.float64, requires_grad=True)
    b = torch.randn(d, dtype=torch.float64, requires_grad=True)
    w, x = torch.randn(d, dtype=torch.float64), torch.randn(1, d, dtype=torch.float64)
    reward = one_step_x0(x, x @ W.T + b, sigma).double() @ w
    c = float(reward.detach()) + 1.0  # active
    (lam * reward_objective(reward, c)).sum().backward()
    torch.testing.assert_close(W.grad, lam * sigma * torch.outer(w, x[0]), rtol=1e-6, atol=0)
    W.grad = None
    reward = one_step_x0(x, x @ W.T + b, sigma).double() @ w
    (lam * reward_objective(reward, float(reward.detach()) - 0.5)).sum().backward()
    assert float(W.grad.abs().max()) == 0.0  # R ≥ c: no gradient
    assert torch.equal(reward_objective(torch.tensor([0.2, 0.9]), None), torch.tensor([-0.2, -0.9]))


@pytest.mark.parametrize("k", [1, 2, 5])
def test_draft_k_gradient_reaches_only_the_last_k_steps(k):
    """One parameter a_i per step (v_i = a_i·x): the first N − K steps run without gradient (the rollout), the last K
    through euler_unroll; the copies before them get exactly no gradient, the last K the hand derivative of
    x_N = x_{N−K}·Π(1 + a_i·dt_i) summed over elements."""
    a = torch.linspace(0.3, 1.1, 5, dtype=torch.float64).requires_grad_(True)
    x = torch.randn(2, 3, dtype=torch.float64)
    start = 5 - k
    with torch.no_grad():
        for i in range(start):
            x = x + a[i] * x * (GRID[i + 1] - GRID[i])
    steps = iter(range(start, 5))

    def velocity(latents, sigmas):
        return a[next(steps)] * latents

    final, first = euler_unroll(velocity, x, GRID[start:].double(), per_step_checkpoint=False)
    final.sum().backward()
    dt = (GRID[1:] - GRID[:-1]).double()
    factors = 1 + a.detach() * dt
    product = factors[start:].prod()
    expected = torch.zeros(5, dtype=torch.float64)
    for i in range(start, 5):
        expected[i] = x.sum() * product / factors[i] * dt[i]
    torch.testing.assert_close(a.grad, expected, rtol=1e-9, atol=0)
    assert bool((a.grad[:start] == 0).all())
    torch.testing.assert_close(first, a.detach()[start] * x)


def test_checkpointed_unroll_equals_plain_autograd():
    """K = N with per-step checkpointing: the same x_N and the same gradient as the plain unrolled graph."""
    net = torch.nn.Linear(3, 3).double()
    x = torch.randn(2, 3, dtype=torch.float64)

    def velocity(latents, sigmas):
        return net(latents) * sigmas[:, None]

    grads = []
    for flag in (False, True):
        net.zero_grad()
        final, _ = euler_unroll(velocity, x, GRID.double(), per_step_checkpoint=flag)
        final.pow(2).sum().backward()
        grads.append((final.detach(), net.weight.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=1e-12)


def test_draft_one_is_refl_at_the_last_step():
    v, x = torch.randn(2, 3), torch.randn(2, 3)
    final, _ = euler_unroll(lambda latents, sigmas: v, x, GRID[-2:], per_step_checkpoint=False)
    torch.testing.assert_close(final, one_step_x0(x, v, GRID[-2]))


def test_lv_copies_renoise_the_detached_sample():
    final = torch.randn(2, 3, requires_grad=True)
    noise = torch.randn(2, 4, 3)
    copies = lv_copies(final, noise, 0.1)
    assert copies.shape == (2, 4, 3) and not copies.requires_grad
    torch.testing.assert_close(copies, 0.9 * final.detach()[:, None] + 0.1 * noise)


@pytest.mark.parametrize("branch", [DENOISE, INVERSION])
@pytest.mark.parametrize(("hi", "lo"), [(0.9, 0.88), (0.75, 0.5), (0.5, 0.0)])
def test_direct_align_recovers_x0_exactly_at_the_injected_noise(branch, hi, lo):
    x0, noise = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    sigma_hi, sigma_lo = torch.full((3,), hi, dtype=torch.float64), torch.full((3,), lo, dtype=torch.float64)
    x, sigma = direct_align_input(x0, noise, sigma_hi, sigma_lo, branch)
    torch.testing.assert_close(sigma, sigma_hi if branch == DENOISE else sigma_lo)
    recovered = direct_align_x0(x, noise - x0, noise, sigma_hi, sigma_lo, branch)
    torch.testing.assert_close(recovered, x0, rtol=0, atol=1e-12)


def test_direct_align_derivatives_and_the_refl_limit():
    """∂x̂₀/∂v = −Δσ/(1 − σ_lo) denoising, +Δσ/(1 − σ_hi) inverting; σ_lo = 0 denoising is ReFL's x̂₀ at σ_hi."""
    x0, noise = torch.randn(1, 2), torch.randn(1, 2)
    hi, lo = torch.tensor([0.8]), torch.tensor([0.7])
    for branch, slope in ((DENOISE, -0.1 / 0.3), (INVERSION, 0.1 / 0.2)):
        x, _ = direct_align_input(x0, noise, hi, lo, branch)
        v = torch.zeros(1, 2, requires_grad=True)
        direct_align_x0(x, v, noise, hi, lo, branch).sum().backward()
        torch.testing.assert_close(v.grad, torch.full((1, 2), slope), rtol=1e-5, atol=0)
    x, v = torch.randn(1, 2), torch.randn(1, 2)
    torch.testing.assert_close(direct_align_x0(x, v, noise, hi, torch.zeros(1), DENOISE), one_step_x0(x, v, hi))
    with pytest.raises(ValueError, match="branch"):
        direct_align_x0(x, v, noise, hi, lo, "sideways")


def test_relative_reward_and_velocity_penalty_against_hand_values():
    torch.testing.assert_close(relative_reward(torch.tensor([0.5]), torch.tensor([0.2]), 0.1), torch.tensor([0.35]))
    v, ref = torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(velocity_penalty(v, ref), torch.tensor([2.5, 0.0]))
