"""DiffusionNFT: the advantage-to-r mapping and the implicit positive/negative policy loss (its KL to a reference and
the old policy's EMA are `diffusion/shadow.py`'s, shared with AWM)."""

from __future__ import annotations

import torch

from miles.diffusion.schedule import expand_like

WEIGHT_FLOOR = 1e-5


def advantage_to_r(adv: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clamp(clip(A, −c, c)/c/2 + ½, 0, 1) in float32: r(0) = ½, A ≤ −c → 0, A ≥ c → 1."""
    clipped = adv.float().clamp(-adv_clip_max, adv_clip_max)
    return (clipped / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).mean(dim=1)


def _adaptive_weight(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _per_sample_mean((x0_pred.double() - x0.double()).abs()).clamp(min=WEIGHT_FLOOR)


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor | float,
    r: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    adaptive_weight: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample (B,) c·[r·mean((x̂₀⁺ − x₀)²)/w⁺ + (1 − r)·mean((x̂₀⁻ − x₀)²)/w⁻]/β, c = adv_clip_max.

    v⁺ = β·v_θ + (1 − β)·v_old, v⁻ = (1 + β)·v_old − β·v_θ, x̂₀^± = x_t − t·v^±; w^± = mean over dims of
    |x̂₀^± − x₀| per sample in float64 without gradient, floored at 1e-5 (1 when `adaptive_weight` is off).
    v_old is detached here. The KL term to a reference is separate: `shadow.velocity_kl`.
    """
    v_theta = v_theta.float()
    v_old = v_old.detach().float()
    x0 = x0.float()
    x_t = x_t.float()
    t_b = expand_like(t, x_t)
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    x0_pos = x_t - t_b * v_pos
    x0_neg = x_t - t_b * v_neg
    if adaptive_weight:
        w_pos = _adaptive_weight(x0_pos, x0).float()
        w_neg = _adaptive_weight(x0_neg, x0).float()
    else:
        w_pos = w_neg = torch.ones(x0.shape[0], dtype=torch.float32, device=x0.device)
    pos = _per_sample_mean((x0_pos - x0) ** 2) / w_pos
    neg = _per_sample_mean((x0_neg - x0) ** 2) / w_neg
    r = r.float().reshape(-1)
    loss = adv_clip_max * (r * pos + (1 - r) * neg) / beta
    with torch.no_grad():
        metrics = {
            "positive_loss": pos.mean(),
            "negative_loss": neg.mean(),
            "weight_pos": w_pos.mean(),
            "weight_neg": w_neg.mean(),
            "old_deviate": ((v_theta - v_old) ** 2).mean(),
        }
    return loss, metrics
