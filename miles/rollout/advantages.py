"""GRPO advantages: rewards normalised within each prompt group (mean per group, std per group or batch)."""

from __future__ import annotations

import torch


def compute_grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    globalize_std: bool = False,
    normalize_std: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """A = (r − mean_group)/(std + eps), float32 (N,), groups being consecutive runs of `group_size` rewards.

    std is the population std of the group, or of the whole batch with `globalize_std`; groups whose rewards
    are all equal (including group_size 1) get A = 0 exactly. normalize_std=False gives r − mean_group.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D (one per sample), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} "
            "(check --n-samples-per-prompt against the rollout batch size)"
        )
    grouped = rewards.double().reshape(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        if globalize_std:
            std = rewards.double().std(unbiased=False)
        else:
            std = grouped.std(dim=1, unbiased=False, keepdim=True)
        centred = centred / (std + eps)
    zero_spread = (grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)).expand_as(grouped)
    advantages = torch.where(zero_spread, torch.zeros_like(centred), centred)
    return advantages.reshape(-1).float()


def per_reward_group_advantages(
    terms: dict[str, torch.Tensor],
    weights: dict[str, float],
    group_size: int,
    *,
    globalize_std: bool = False,
    normalize_std: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """A = Σ_k w_k · A_k, float32 (N,), where A_k is `compute_grpo_advantages` of reward k's raw values alone: every
    reward is normalised within its prompt group before weighting, so its scale no longer sets its share.

    With one reward of weight w this is w times GRPO of that reward (GRPO of the weighted sum does not see w > 0).
    """
    if not terms or set(terms) != set(weights):
        raise ValueError(f"reward terms {sorted(terms)} do not match the weighted rewards {sorted(weights)}")
    total = torch.zeros(next(iter(terms.values())).numel(), dtype=torch.float64)
    for name, values in terms.items():
        grpo = compute_grpo_advantages(
            values, group_size, globalize_std=globalize_std, normalize_std=normalize_std, eps=eps
        )
        total += weights[name] * grpo.double()
    return total.float()
