"""GRPO-Guard (arXiv 2510.22319): the normalised ratio r̂ of an SDE step and its clipped, per-step reweighted loss."""

from __future__ import annotations

import math

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


def clip_decision(log_ratio: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(below, above) bool masks (B,): log r̂ < log(1 − c) and log r̂ > log(1 + c), decided in float64 on the log-ratio.

    At the recipe clip c = 2e-6 a float32 r̂ = exp(log r̂) cannot decide it: its spacing near 1 (6e-8 below, 1.2e-7
    above) is 3-6% of c, and the float32 edges 1 ± c themselves round 1.3% outwards, so a log-ratio up to ~4% past
    the edge rounds onto the edge and would keep the unclipped gradient. log r̂ itself is exact to ~1e-13 there."""
    exact = log_ratio.detach().double()
    return exact < math.log1p(-clip_range), exact > math.log1p(clip_range)


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
    Returns (loss, r̂).

    The max picks the clipped branch (the constant −A·(1 ± c), no gradient) exactly where r̂ is past the edge the
    advantage pushes it to (A > 0 above 1 + c, A < 0 below 1 − c), decided by `clip_decision`; elsewhere −A·r̂ with
    its float32 r̂, the same value and gradient as the float32 max of the two branches."""
    log_ratio = fp32_or_wider(log_ratio)
    ratio = torch.exp(log_ratio)
    adv = fp32_or_wider(advantages).clamp(-adv_clip_max, adv_clip_max)
    below, above = clip_decision(log_ratio, clip_range)
    clipped = (above & (adv > 0)) | (below & (adv < 0))
    edge = torch.full_like(ratio, 1.0 - clip_range).masked_fill(above, 1.0 + clip_range)  # clamp's edges
    loss = torch.where(clipped, -adv * edge, -adv * ratio)
    if step_reweight:
        loss = loss / (-fp32_or_wider(dt))
    return loss, ratio
