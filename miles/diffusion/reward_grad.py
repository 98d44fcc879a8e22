"""The maths the reward-gradient losses share (ReFL, DRaFT-K / DRaFT-LV, Direct-Align, dmd2's reward term): the
one-step x̂₀, the differentiable Euler unroll over the last K steps, DRaFT-LV's re-noised copies, Direct-Align's
noise injection and analytic x̂₀ recovery, and the reward objective (a hinge or the plain negated reward).

Flow-matching conventions (ALGORITHMS.md): x_σ = (1 − σ)·x₀ + σ·ε, v ≈ ε − x₀, Euler x' = x + v·(σ' − σ).
Pure tensor functions in float32 (float64 stays float64): no Ray, no process group, no argparse.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from miles.diffusion.policy import fp32_or_wider as wide
from miles.diffusion.schedule import expand_like

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x (B, ...), σ (B,)) -> v (B, ...)
DENOISE, INVERSION = "denoise", "inversion"  # Direct-Align's two branches


def one_step_x0(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
    """x̂₀ = x − σ·v (ReFL's prediction at σ_j; the Euler step from σ to 0)."""
    return wide(x) - wide(expand_like(sigma, x)) * wide(v)


def euler_unroll(
    velocity: VelocityFn, x: torch.Tensor, sigmas: torch.Tensor, *, per_step_checkpoint: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Euler from `x` at sigmas[0] through sigmas[1:] (K = len − 1 steps, one σ grid (K + 1,) shared by the batch),
    differentiable through every step; returns (x at sigmas[-1], the first step's velocity).

    With `per_step_checkpoint` each step's activations are recomputed in the backward pass (non-reentrant activation
    checkpointing), so memory holds one step's activations and the K step inputs, not K steps' activations."""
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(f"euler_unroll needs a 1-D σ grid of at least 2 values, got shape {tuple(sigmas.shape)}")
    batch = x.shape[0]
    first: torch.Tensor | None = None
    for i in range(sigmas.numel() - 1):
        sigma = sigmas[i].expand(batch)
        dt = wide(sigmas[i + 1] - sigmas[i])
        if per_step_checkpoint and torch.is_grad_enabled():
            v = checkpoint(velocity, x, sigma, use_reentrant=False)
        else:
            v = velocity(x, sigma)
        first = v if first is None else first
        x = wide(x) + wide(v) * dt
    assert first is not None
    return x, first


def lv_copies(x_final: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """DRaFT-LV's n re-noised copies (B, n, ...) of the detached sample x_N: (1 − σ)·sg(x_N) + σ·ε_m, ε of shape
    (B, n, ...), σ = σ_{N−1} (the last grid step's noise level)."""
    clean = wide(x_final.detach()).unsqueeze(1)
    return (1 - sigma) * clean + sigma * wide(noise)


def inject_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
    """x_σ = (1 − σ)·x₀ + σ·ε with a known ε (Direct-Align's injection)."""
    s = wide(expand_like(sigma, x0))
    return (1 - s) * wide(x0) + s * wide(noise)


def direct_align_input(
    x0: torch.Tensor, noise: torch.Tensor, sigma_hi: torch.Tensor, sigma_lo: torch.Tensor, branch: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the network's input x, its σ): denoising starts at σ_hi, inversion at σ_lo."""
    if branch not in (DENOISE, INVERSION):
        raise ValueError(f"Direct-Align branch must be {DENOISE!r} or {INVERSION!r}, got {branch!r}")
    sigma = sigma_hi if branch == DENOISE else sigma_lo
    return inject_noise(x0, noise, sigma), sigma


def direct_align_x0(
    x: torch.Tensor,
    v: torch.Tensor,
    noise: torch.Tensor,
    sigma_hi: torch.Tensor,
    sigma_lo: torch.Tensor,
    branch: str,
) -> torch.Tensor:
    """x̂₀ recovered analytically after one step between σ_hi > σ_lo, Δσ = σ_hi − σ_lo, the injected ε known:
    denoising x' = x − Δσ·v, x̂₀ = (x' − σ_lo·ε)/(1 − σ_lo); inversion x' = x + Δσ·v, x̂₀ = (x' − σ_hi·ε)/(1 − σ_hi).
    Exact (x̂₀ = x₀) when v = ε − x₀."""
    hi, lo = wide(expand_like(sigma_hi, x)), wide(expand_like(sigma_lo, x))
    delta = hi - lo
    if branch == DENOISE:
        return (wide(x) - delta * wide(v) - lo * wide(noise)) / (1 - lo)
    if branch == INVERSION:
        return (wide(x) + delta * wide(v) - hi * wide(noise)) / (1 - hi)
    raise ValueError(f"Direct-Align branch must be {DENOISE!r} or {INVERSION!r}, got {branch!r}")


def relative_reward(positive: torch.Tensor, negative: torch.Tensor, k: float) -> torch.Tensor:
    """SRPO's semantic-relative reward r = (1 + k)·R(x, c⁺) − R(x, c⁻)."""
    return (1 + k) * positive - negative


def reward_objective(reward: torch.Tensor, hinge: float | None) -> torch.Tensor:
    """Per-sample loss of a reward to ascend: φ_c(R) = ReLU(c − R) with hinge c (no gradient once R ≥ c), or −R."""
    return -reward if hinge is None else torch.relu(hinge - reward)


def velocity_penalty(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """(B,) mean over non-batch dims of (v_θ − v_ref)²: the KL / reference-velocity regulariser."""
    return (wide(v) - wide(v_ref)).pow(2).flatten(1).mean(dim=1)
