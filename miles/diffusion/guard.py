"""GRPO-Guard (arXiv 2510.22319): the normalised ratio r̂ of an SDE step and its clipped, per-step reweighted loss."""

from __future__ import annotations

import torch

from miles.diffusion.policy import fp32_or_wider


def _per_sample(step_std: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return fp32_or_wider(step_std).reshape(-1, *([1] * (like.dim() - 1)))


def normalized_log_ratio(
    mean: torch.Tensor, old_mean: torch.Tensor, next_latents: torch.Tensor, step_std: torch.Tensor
) -> torch.Tensor:
    """RatioNorm, per sample (B,): log r̂ = mean over dims of z·Δμ with z = (x' − μ_old)/s and Δμ = μ_θ − μ_old.

    It equals s·(log r + mean(Δμ²)/(2s²)) for the Gaussian step ratio r: the bias term that keeps the plain ratio's
    mean below 1 is removed and the 1/s scale that differs from step to step is taken out. `step_std` (B,) is the
    step's true std s; `old_mean` and `next_latents` are constants (pass them detached)."""
    old = fp32_or_wider(old_mean)
    z = (fp32_or_wider(next_latents) - old) / _per_sample(step_std, old)
    return (z * (fp32_or_wider(mean) - old)).reshape(mean.shape[0], -1).mean(dim=1)


def guard_policy_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    dt: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    step_reweight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample (B,) L = w·max(−A·r̂, −A·clip(r̂, 1 − c, 1 + c)), r̂ = exp(log_ratio), A clamped to ±adv_clip_max,
    w = 1/(−dt) with `step_reweight` (the same gradient scale at every step; it acts like a larger lr), else 1.
    Returns (loss, r̂)."""
    ratio = torch.exp(fp32_or_wider(log_ratio))
    adv = fp32_or_wider(advantages).clamp(-adv_clip_max, adv_clip_max)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range))
    if step_reweight:
        loss = loss / (-fp32_or_wider(dt))
    return loss, ratio
