"""Flow-DPPO: the unclipped policy ratio objective with a trust region on the exact Gaussian KL of an SDE step."""

from __future__ import annotations

import torch

from miles.diffusion.policy import fp32_or_wider


def gaussian_mean_kl(mean: torch.Tensor, old_mean: torch.Tensor, step_std: torch.Tensor) -> torch.Tensor:
    """Per sample (B,): KL(N(μ_θ, s²) ‖ N(μ_old, s²)) per latent element = mean over dims of (μ_θ − μ_old)²/(2s²),
    with s (B,) the step's true std (not std_t: this is the exact KL, not the Flow-GRPO reference's)."""
    s = fp32_or_wider(step_std).reshape(-1, *([1] * (mean.dim() - 1)))
    return ((fp32_or_wider(mean) - fp32_or_wider(old_mean)) ** 2 / (2 * s**2)).reshape(mean.shape[0], -1).mean(dim=1)


def kl_masked_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    kl: torch.Tensor,
    advantages: torch.Tensor,
    *,
    kl_threshold: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (B,) L = −A·r, r = exp(logp − logp_old), A clamped to ±adv_clip_max, set to 0 (value and gradient)
    where the transition is outside the trust region (kl ≥ kl_threshold) AND the update moves further from the
    rollout policy (r > 1 with A > 0, or r < 1 with A < 0: the gradient of −A·r would push r further from 1).
    Returns (loss, r, keep) with `keep` the bool mask of the transitions that count. A dropped transition's ratio
    is never exponentiated, so an overflowed one gives neither a NaN loss nor a NaN gradient (inf·0)."""
    log_ratio = fp32_or_wider(log_prob) - fp32_or_wider(old_log_prob)
    adv = fp32_or_wider(advantages).clamp(-adv_clip_max, adv_clip_max)
    outside = kl.detach() >= kl_threshold
    away = ((log_ratio > 0) & (adv > 0)) | ((log_ratio < 0) & (adv < 0))
    keep = ~(outside & away).detach()
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    kept_ratio = torch.exp(torch.where(keep, log_ratio, zero))
    loss = torch.where(keep, -adv * kept_ratio, zero)
    return loss, torch.exp(log_ratio.detach()), keep
