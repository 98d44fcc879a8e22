"""GRPO-Guard's normalised ratio and loss against the Gaussian step written out (ALGORITHMS.md "GRPO-Guard")."""

from __future__ import annotations

import math

import pytest
import torch

from miles.diffusion.guard import clip_decision, guard_policy_loss, normalized_log_ratio
from miles.diffusion.sde import sde_step

D = 2 * 4 * 4  # latent elements per sample


def gaussian_log_prob(x_next, mean, s):
    """Per-sample mean over dims of the N(mean, s²) log-density, s (B,)."""
    s = s.reshape(-1, 1, 1, 1)
    density = -((x_next - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    return density.reshape(x_next.shape[0], -1).mean(dim=1)


def test_identity_with_the_plain_log_ratio_in_float64():
    # log r̂ = s·(log r + mean(Δμ²)/(2s²)) with r the ratio of the two Gaussian densities of x' = μ_old + s·z
    g = torch.Generator().manual_seed(0)
    mean_old, delta = torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64), None
    delta = 0.05 * torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64)
    s = torch.tensor([0.31, 0.07, 0.012], dtype=torch.float64)
    z = torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64)
    x_next = mean_old + s.reshape(-1, 1, 1, 1) * z
    mean = mean_old + delta
    log_r = gaussian_log_prob(x_next, mean, s) - gaussian_log_prob(x_next, mean_old, s)
    expected = s * (log_r + (delta**2).reshape(3, -1).mean(dim=1) / (2 * s**2))
    got = normalized_log_ratio(mean, mean_old, x_next, s)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, atol=1e-9, rtol=0)
    torch.testing.assert_close(got, (z * delta).reshape(3, -1).mean(dim=1), atol=1e-12, rtol=0)


def test_normalised_log_ratio_has_mean_zero_where_the_plain_one_is_biased():
    g = torch.Generator().manual_seed(1)
    n, s = 20000, torch.full((20000,), 0.05, dtype=torch.float64)
    mean_old = torch.zeros(n, 8, dtype=torch.float64)
    delta = (0.02 * torch.randn(1, 8, generator=g, dtype=torch.float64)).expand(n, 8)  # one fixed Δμ
    x_next = mean_old + s[:, None] * torch.randn(n, 8, generator=g, dtype=torch.float64)
    log_hat = normalized_log_ratio(mean_old + delta, mean_old, x_next, s)
    assert abs(log_hat.mean().item()) < 4 * log_hat.std().item() / math.sqrt(n)
    # the plain log-ratio's mean is −mean(Δμ²)/(2s²) (here about −0.08), far outside its Monte Carlo error
    log_r = log_hat / s - (delta**2).mean(dim=1) / (2 * s**2)
    bias = -(delta[0] ** 2).mean().item() / (2 * 0.05**2)
    assert log_r.mean().item() == pytest.approx(bias, abs=4 * log_r.std().item() / math.sqrt(n))
    assert abs(bias) > 20 * log_r.std().item() / math.sqrt(n)


def test_on_policy_ratio_is_one_and_loss_is_minus_advantage_over_minus_dt():
    mean = torch.randn(4, 2, 4, 4)
    x_next = mean + 0.1 * torch.randn(4, 2, 4, 4)
    log_hat = normalized_log_ratio(mean, mean.clone(), x_next, torch.full((4,), 0.1))
    assert torch.equal(log_hat, torch.zeros(4))
    adv = torch.tensor([1.5, -0.5, 7.0, -9.0])
    dt = torch.tensor([-0.1, -0.05, -0.2, -0.01])
    loss, ratio = guard_policy_loss(log_hat, adv, dt, clip_range=2e-6, adv_clip_max=5.0)
    assert torch.equal(ratio, torch.ones(4))
    clamped = torch.tensor([1.5, -0.5, 5.0, -5.0])
    torch.testing.assert_close(loss, -clamped / 0.1 * torch.tensor([1.0, 2.0, 0.5, 10.0]), rtol=1e-6, atol=0)
    unweighted, _ = guard_policy_loss(log_hat, adv, dt, clip_range=2e-6, adv_clip_max=5.0, step_reweight=False)
    torch.testing.assert_close(unweighted, -clamped)


def velocity_gradient(sigma, sigma_next, z, adv, a, *, step_reweight):
    """∂L/∂v at θ = θ_old through the sde kernel: the old mean from the same v, detached."""
    v_old = torch.linspace(-1, 1, D, dtype=torch.float64).reshape(1, 2, 4, 4).float()
    x = torch.linspace(0.5, -0.5, D).reshape(1, 2, 4, 4)
    v = v_old.clone().requires_grad_(True)
    old = sde_step(x, v_old, sigma, sigma_next, noise_level=a, sigma_max=0.96)
    x_next = old.mean + old.step_std.reshape(-1, 1, 1, 1) * z
    new = sde_step(x, v, sigma, sigma_next, noise_level=a, sigma_max=0.96, prev_sample=x_next)
    log_hat = normalized_log_ratio(new.mean, old.mean, x_next, new.step_std)
    dt = torch.tensor([sigma_next - sigma])
    loss, _ = guard_policy_loss(
        log_hat, torch.tensor([adv]), dt, clip_range=2e-6, adv_clip_max=5.0, step_reweight=step_reweight
    )
    loss.sum().backward()
    return v.grad


def test_velocity_gradient_is_the_same_at_every_step_with_reweighting_and_scales_with_dt_without():
    z = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    a, adv = 0.7, 1.3
    steps = [(0.8, 0.7), (0.4, 0.36)]  # |dt| 0.1 and 0.04
    # written out: ∂μ/∂v = (1 + std_t²(1 − σ)/(2σ))·dt = (1 + a²/2)·dt for std_t = a√(σ/(1 − σ)); ∂log r̂/∂μ = z/D
    expected_on = adv * (1 + a**2 / 2) * z / D
    for sigma, sigma_next in steps:
        on = velocity_gradient(sigma, sigma_next, z, adv, a, step_reweight=True)
        torch.testing.assert_close(on, expected_on, rtol=1e-4, atol=1e-7)
        off = velocity_gradient(sigma, sigma_next, z, adv, a, step_reweight=False)
        torch.testing.assert_close(off, expected_on * (sigma - sigma_next), rtol=1e-4, atol=1e-8)


def test_gradient_is_zero_where_clipped():
    c = 2e-6
    mean_old = torch.zeros(4, 8, dtype=torch.float64)
    s = torch.full((4,), 0.1, dtype=torch.float64)
    z = torch.ones(4, 8, dtype=torch.float64)
    x_next = mean_old + 0.1 * z
    # log r̂ = mean(z·Δμ) = Δ: above 1 + c, above 1 + c, below 1 − c, below 1 − c
    deltas = torch.tensor([1e-4, 1e-4, -1e-4, -1e-4], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    delta = deltas[:, None].expand(4, 8).clone().requires_grad_(True)
    log_hat = normalized_log_ratio(mean_old + delta, mean_old, x_next, s)
    loss, ratio = guard_policy_loss(log_hat, adv, -s, clip_range=c, adv_clip_max=5.0)
    loss.sum().backward()
    grad = delta.grad.sum(dim=1)
    # A > 0 with r̂ > 1 + c and A < 0 with r̂ < 1 − c sit on the clipped branch: no gradient; the others keep −A·r̂'s
    assert grad[0].item() == 0.0 and grad[2].item() == 0.0
    for i in (1, 3):
        expected = -adv[i].item() * ratio[i].item() / 0.1  # ∂(w·(−A·r̂))/∂Δ summed over dims, w = 1/0.1
        assert grad[i].item() == pytest.approx(expected, rel=1e-9)


RECIPE_CLIP = 2e-6  # GRPO-Guard's c: float32's spacing near 1 (6e-8 below, 1.2e-7 above) is 3-6% of it


def loss_and_grad(log_ratio, adv, loss_fn):
    """Per-sample loss and ∂loss/∂log r̂ (each sample's loss depends on its own log-ratio only)."""
    log_ratio = log_ratio.clone().requires_grad_(True)
    loss = loss_fn(log_ratio, adv)
    loss.sum().backward()
    return loss.detach(), log_ratio.grad


def new_loss(c):
    return lambda lr, adv: guard_policy_loss(lr, adv, -torch.ones_like(adv), clip_range=c, adv_clip_max=5.0)[0]


def max_of_branches(c):  # the max of the two branches in the inputs' dtype: float32 decides the clip on the float32 r̂
    def loss(lr, adv):
        ratio = torch.exp(lr)
        return torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - c, 1.0 + c))

    return loss


def edge_log_ratios(c):
    """Log-ratios inside and outside log(1 ± c) by 1e-10 .. 5e-8, less than float32's spacing of r̂ there."""
    margins = torch.tensor([1e-10, 1e-9, 1e-8, 5e-8], dtype=torch.float64)
    high, low = math.log1p(c), math.log1p(-c)
    values = torch.cat([high - margins, high + margins, low + margins, low - margins])
    outside = torch.cat([torch.zeros(4), torch.ones(4), torch.zeros(4), torch.ones(4)]).bool()
    return values.float(), outside


def test_the_clip_is_decided_exactly_at_the_edge_against_a_float64_reference():
    c = RECIPE_CLIP
    log_ratio, outside = edge_log_ratios(c)
    assert (log_ratio.double() - log_ratio.double().clamp(math.log1p(-c), math.log1p(c)) != 0).eq(outside).all()
    below, above = clip_decision(log_ratio, c)
    reference_ratio = torch.exp(log_ratio.double())
    assert torch.equal(below | above, (reference_ratio - 1.0).abs() > c)  # train/clipfrac's samples
    assert torch.equal(below | above, outside)
    for sign in (1.0, -1.0):
        adv = torch.full_like(log_ratio, sign)
        loss, grad = loss_and_grad(log_ratio, adv, new_loss(c))
        ref_loss, ref_grad = loss_and_grad(log_ratio.double(), adv.double(), max_of_branches(c))  # exact here
        assert torch.equal(grad == 0, ref_grad == 0)  # which samples keep a gradient: exactly the reference's
        assert (grad == 0).sum() == 4  # A > 0 above 1 + c, or A < 0 below 1 − c
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-6, atol=0)
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=0)
        # the float32 decision this replaces keeps the unclipped gradient on some samples past the edge
        _, f32_grad = loss_and_grad(log_ratio, adv, max_of_branches(c))
        assert ((f32_grad != 0) & (ref_grad == 0)).any()


def test_against_the_float32_max_only_the_samples_at_the_edges_change():
    c = RECIPE_CLIP
    g = torch.Generator().manual_seed(7)
    log_ratio = (torch.linspace(-3.0, 3.0, 4001, dtype=torch.float64) * c).float()
    adv = (torch.rand(4001, generator=g) * 2.0 - 1.0) * 4.0  # within the advantage clip (5)
    loss, grad = loss_and_grad(log_ratio, adv, new_loss(c))
    _, ref_grad = loss_and_grad(log_ratio.double(), adv.double(), max_of_branches(c))
    assert torch.equal(grad == 0, ref_grad == 0)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-6, atol=0)
    f32_loss, f32_grad = loss_and_grad(log_ratio, adv, max_of_branches(c))
    assert torch.equal(loss, f32_loss)  # a sample that moves to the clipped branch sat on the float32 edge already
    clipped_now = (grad == 0) & (f32_grad != 0)  # past the edge by less than float32's rounding of r̂ and 1 ± c
    past = log_ratio.double().abs()[clipped_now] / c - 1.0
    assert clipped_now.any() and past.min() > 0 and past.max() < 0.045
    # the float32 max also halved the gradient where its two branches rounded to the same product (a tie, within
    # float32's spacing of an edge, on either side): now the whole −A·r̂ gradient, as in float64
    halved = (grad != f32_grad) & (f32_grad != 0) & (grad != 0)
    assert halved.any() and torch.equal(grad[halved], 2 * f32_grad[halved])
    assert (log_ratio.double().abs()[halved] / c - 1.0).abs().max() < 0.06
    assert not ((grad != 0) & (f32_grad == 0)).any()  # never a sample the float32 max clipped
    same = ~(clipped_now | halved)
    assert torch.equal(grad[same], f32_grad[same])  # every other gradient bit for bit
