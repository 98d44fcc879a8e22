"""The maths of training against frozen copies of the trained network, shared by several algorithms: the velocity-space
KL to a frozen network (the reference, an EMA anchor: DiffusionNFT, AWM), the EMA decay schedule of a shadow network
(NFT's old policy, AWM's EMA anchor) and the in-place EMA update (shadows and --use-ema)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def velocity_kl(v_theta: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """Per-sample (B,) mean((v_θ − v_ref)²), weighted by the KL weight (1e-4 in the reference) outside."""
    d = (v_theta.float() - v_ref.detach().float()) ** 2
    return d.reshape(d.shape[0], -1).mean(dim=1)


def old_policy_decay(step: int, *, rate: float = 0.001, max_decay: float = 0.5, flat_steps: int = 0) -> float:
    """EMA decay d of the old policy after rollout `step`: 0 for the first `flat_steps`, then rising by `rate`
    per step, capped at `max_decay`: d = min(rate·(step − flat_steps), max_decay). d = 0 means old = current.
    The reference's presets: (0.001, 0.5, 0) and (0.0075, 0.999, 75); rate 0 gives d ≡ 0."""
    if step < flat_steps:
        return 0.0
    return min(rate * (step - flat_steps), max_decay)


@torch.no_grad()
def ema_update_(old_params: Iterable[torch.Tensor], new_params: Iterable[torch.Tensor], decay: float) -> None:
    """In place: old ← decay·old + (1 − decay)·new, tensor by tensor (lists must pair up one to one)."""
    old_list, new_list = list(old_params), list(new_params)
    if len(old_list) != len(new_list):
        raise ValueError(f"ema_update_ got {len(old_list)} old tensors but {len(new_list)} new ones")
    for old, new in zip(old_list, new_list):
        old.lerp_(new.to(device=old.device, dtype=old.dtype), 1.0 - decay)
