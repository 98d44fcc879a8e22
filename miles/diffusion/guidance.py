"""Classifier-free guidance: one batched [uncond; cond] forward, split and combined."""

from __future__ import annotations

import torch


def uses_cfg(scale: float) -> bool:
    """Guidance only changes the velocity for scale > 1 (scale 1 is the conditional branch alone)."""
    return scale > 1.0


def cfg_combine(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale·(cond − uncond)."""
    return uncond + scale * (cond - uncond)


def make_cfg_batch(uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """Stack the two branches along the batch dim, uncond first, for one forward."""
    return torch.cat([uncond, cond], dim=0)


def split_cfg_batch(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a batched [uncond; cond] output back into (uncond, cond)."""
    if output.shape[0] % 2:
        raise ValueError(f"a CFG batch stacks [uncond; cond] and must be even, got batch size {output.shape[0]}")
    uncond, cond = output.chunk(2, dim=0)
    return uncond, cond


def guided_velocity(batched_output: torch.Tensor, scale: float) -> torch.Tensor:
    """The combined velocity from a batched [uncond; cond] forward."""
    uncond, cond = split_cfg_batch(batched_output)
    return cfg_combine(uncond, cond, scale)
