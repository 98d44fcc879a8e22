"""Policy-ratio maths several algorithms share: the PPO clipped objective over per-sample log-probs (Flow-GRPO's, and
AWM's on its flow-matching log-prob) and the precision rule of the SDE arithmetic (GRPO-Guard, Flow-DPPO)."""

from __future__ import annotations

import torch


def fp32_or_wider(x: torch.Tensor) -> torch.Tensor:
    """fp32 for half inputs (the SDE arithmetic's dtype); float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample (B,) L = max(−A·ratio, −A·clip(ratio, 1 − ε, 1 + ε)), ratio = exp(logp − logp_old), A clamped
    to ±adv_clip_max. Metrics (detached scalars): ratio_mean, clipfrac, approx_kl = ½·mean(Δlogp²)."""
    log_ratio = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(log_ratio)
    adv = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        metrics = {
            "ratio_mean": ratio.mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "approx_kl": 0.5 * (log_ratio**2).mean(),
        }
    return loss, metrics
