"""Flow-matching sigma grids, timestep densities, loss weightings and the SFT flow-matching loss.

Convention: x_σ = (1 − σ)·x₀ + σ·ε, σ = 1 is pure noise, the network predicts v ≈ ε − x₀.
"""

from __future__ import annotations

import math

import torch

TIMESTEP_DENSITIES = ("logit_normal", "uniform", "mode")
LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


def sampling_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """The scheduler's own sampling grid: num_steps + 1 float32 values from 1 down to 0.

    Read from diffusers, never recomputed: `set_timesteps` shifts the low end twice (the last nonzero
    σ of a 10-step shift-3 grid is ~0.0089), and the engine must train on exactly the σ it sampled with.
    """
    # here: the loss hub imports this module for its maths only (and from its module: diffusers' top level types it as
    # the torch-less dummy for mypy)
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.detach().to(torch.float32).cpu().clone()


def training_sigmas(shift: float = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The scheduler's training table (num_train_timesteps float32 values, descending from 1)."""
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
    return scheduler.sigmas.detach().to(torch.float32).cpu().clone()


def sample_timestep_density(
    scheme: str,
    batch_size: int,
    *,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Draw u in [0, 1] (B,) as SD3 training does: sigmoid(N(mean, std)), uniform, or mode-scaled uniform."""
    if scheme == "logit_normal":
        z = torch.randn(batch_size, generator=generator, device=device) * logit_std + logit_mean
        return torch.sigmoid(z)
    if scheme == "uniform":
        return torch.rand(batch_size, generator=generator, device=device)
    if scheme == "mode":
        u = torch.rand(batch_size, generator=generator, device=device)
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    raise ValueError(f"unknown timestep density {scheme!r}; valid: {', '.join(TIMESTEP_DENSITIES)}")


def sigmas_from_u(u: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Look u in [0, 1] up on a sigma table: index = (u·len).long(), clamped, as the diffusers SD3 script does."""
    indices = (u * len(table)).long().clamp(0, len(table) - 1)
    return table.to(u.device)[indices]


def loss_weighting(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weight w(σ): 'none' → 1, 'sigma_sqrt' → σ⁻², 'cosmap' → 2/(π(1 − 2σ + 2σ²))."""
    sigmas = sigmas.float()
    if scheme == "none":
        return torch.ones_like(sigmas)
    if scheme == "sigma_sqrt":
        return sigmas**-2.0
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    raise ValueError(f"unknown loss weighting {scheme!r}; valid: {', '.join(LOSS_WEIGHTINGS)}")


def expand_like(values: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Per-sample values (B,) or a scalar as a float32 tensor of shape (B, 1, ..., 1) broadcastable over `like`."""
    values = torch.as_tensor(values, dtype=torch.float32, device=like.device)
    if values.ndim == 0:
        values = values.expand(like.shape[0])
    return values.reshape(-1, *([1] * (like.ndim - 1)))


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor | float) -> torch.Tensor:
    """x_σ = (1 − σ)·x₀ + σ·ε, computed in float32 and returned in x₀'s dtype (it is the network input)."""
    s = expand_like(sigmas, x0)
    return ((1 - s) * x0.float() + s * noise.float()).to(x0.dtype)


def flow_matching_loss(
    v_pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigmas: torch.Tensor | float,
    weighting: str = "none",
) -> torch.Tensor:
    """Per-sample (B,) float32 loss: mean over non-batch dims of w(σ)·(v − (ε − x₀))²."""
    target = noise.float() - x0.float()
    w = expand_like(loss_weighting(weighting, expand_like(sigmas, x0).flatten()), x0)
    per_element = w * (v_pred.float() - target) ** 2
    return per_element.reshape(per_element.shape[0], -1).mean(dim=1)
