"""MixGRPO-Flash's ODE after the SDE window: the compressed, re-shifted σ grid and one multistep DPM-Solver++(2M)
step in x₀ form (Lu et al. 2022, arXiv 2211.01095), for the flow-matching path x_σ = (1 − σ)·x₀ + σ·ε (α = 1 − σ).
"""

from __future__ import annotations

import math

import torch

from miles.diffusion.sde import SIGMA_ONE_ATOL


def flash_sigmas(sigmas: torch.Tensor, last_window_step: int, ratio: float, shift: float) -> torch.Tensor:
    """The grid of a Flash rollout: `sigmas[: L + 1]` (steps 0 .. L keep their σ and σ'), then n_post =
    max(int((N − L)·ratio), 2) points from σ_{L+1} down to 0, uniform in the unshifted time t and shifted by
    `shift` (σ = s·t/(1 + (s − 1)·t)). The first post point is σ_{L+1} itself, so step L's σ' is unchanged.

    `sigmas` is the (N + 1,) sampling grid, L = `last_window_step` ≤ N − 3 (its σ' = σ_{L+1} > 0)."""
    num_steps = len(sigmas) - 1
    if not 0 <= last_window_step <= num_steps - 3:
        raise ValueError(
            f"the Flash grid needs the window's last step in [0, {num_steps - 3}] (the window never holds the "
            f"last two of {num_steps} steps), got {last_window_step}"
        )
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"--mixgrpo-flash-ratio must be in (0, 1], got {ratio}")
    n_post = max(int((num_steps - last_window_step) * ratio), 2)
    start = float(sigmas[last_window_step + 1])
    t_start = start / (shift - (shift - 1.0) * start)  # the inverse of the shift at σ_{L+1}
    t = torch.linspace(t_start, 0.0, n_post, dtype=torch.float64)
    post = shift * t / (1.0 + (shift - 1.0) * t)
    post[0] = start  # exactly the grid's value (the inverse and the shift round)
    return torch.cat([sigmas[: last_window_step + 1].float(), post.float()])


def log_snr(sigma: float) -> float:
    """λ = log(α/σ) with α = 1 − σ: −inf at σ = 1, +inf at σ = 0."""
    if sigma <= 0.0:
        return math.inf
    if sigma >= 1.0 - SIGMA_ONE_ATOL:
        return -math.inf
    return math.log((1.0 - sigma) / sigma)


def dpm_solver_pp_step(
    x: torch.Tensor,
    denoised: torch.Tensor,
    sigma: float,
    sigma_next: float,
    *,
    prev_denoised: torch.Tensor | None = None,
    sigma_prev: float | None = None,
) -> torch.Tensor:
    """x at σ → x' at σ' (float32) from x̂₀ = `denoised` at σ (and the previous step's x̂₀ at `sigma_prev`).

    h = λ' − λ, D0 = x̂₀, D1 = (x̂₀ − x̂₀_prev)/r with r = (λ − λ_prev)/h, and the midpoint update
    x' = (σ'/σ)·x − α'·(e^{−h} − 1)·(D0 + D1/2). First order (D1 = 0) without a finite previous λ; the last step
    (σ' = 0) is first order too, x' = x̂₀."""
    d0 = denoised.float()
    if sigma_next <= 0.0:
        return d0
    lam, lam_next = log_snr(sigma), log_snr(sigma_next)
    h = lam_next - lam
    coeff = -(1.0 - sigma_next) * math.expm1(-h)
    update = d0
    if prev_denoised is not None and sigma_prev is not None and math.isfinite(log_snr(sigma_prev)):
        r = (lam - log_snr(sigma_prev)) / h
        update = d0 + (d0 - prev_denoised.float()) / (2.0 * r)
    return (sigma_next / sigma) * x.float() + coeff * update
