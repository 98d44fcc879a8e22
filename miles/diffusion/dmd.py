"""DMD2: the distribution-matching gradient, the generator and critic losses, and their timestep draw."""

from __future__ import annotations

import torch

from miles.diffusion.schedule import expand_like


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).mean(dim=1)


def x0_from_velocity(x_t: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
    """x̂₀ = x_t − σ·v in float32, σ per sample (B,) or a scalar."""
    return x_t.float() - expand_like(sigma, x_t) * v.float()


def dmd_gradient(x: torch.Tensor, x_hat_fake: torch.Tensor, x_hat_real: torch.Tensor) -> torch.Tensor:
    """g = (x̂_fake − x̂_real) / mean over dims |x − x̂_real| per sample, computed in float64; returned float32
    after nan_to_num (applied after the cast, so a zero normaliser gives finite float32 values)."""
    x, fake, real = x.double(), x_hat_fake.double(), x_hat_real.double()
    normaliser = _per_sample_mean((x - real).abs()).reshape(-1, *([1] * (x.ndim - 1)))
    return torch.nan_to_num(((fake - real) / normaliser).float())


def generator_loss(x_theta: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """0.5·mean((x_θ − stopgrad(target))²), target = x − g: at x_θ = x its gradient is g/numel.

    reduction 'none' gives the per-sample (B,) 0.5·mean over dims, whose batch mean is the 'mean' value.
    """
    per_sample = 0.5 * _per_sample_mean((x_theta.float() - target.detach().float()) ** 2)
    if reduction == "none":
        return per_sample
    if reduction == "mean":
        return per_sample.mean()
    raise ValueError(f"unknown reduction {reduction!r}; valid: mean, none")


def critic_loss(v_fake: torch.Tensor, noise: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-sample (B,) denoising flow-matching loss of the critic on detached samples: mean((v − (ε − x))²)."""
    return _per_sample_mean((v_fake.float() - (noise.float() - x.detach().float())) ** 2)


def sample_dmd_timesteps(
    batch: int,
    *,
    shift: float,
    t_min: float = 0.02,
    t_max: float = 0.98,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """σ (B,) float32: u ~ U[0, 1), shifted σ = shift·u/(1 + (shift − 1)·u), then clamped to [t_min, t_max]."""
    u = torch.rand(batch, generator=generator, device=device)
    sigma = shift * u / (1 + (shift - 1) * u)
    return sigma.clamp(t_min, t_max)
