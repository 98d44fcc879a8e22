"""DPO in flow form (Diffusion-DPO, arXiv 2311.12908, with the flow-matching target of flow_grpo's and verl-omni's
online DPO): the preference loss on the flow-matching errors of a chosen and a rejected sample, and the rule that
picks the pair of a prompt group (ALGORITHMS.md, "DPO in flow form"). Model-agnostic: no Ray, no FSDP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def flow_error(pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """e = mean over non-batch dims of (v − (ε − x₀))², (B,) in fp32."""
    target = noise.float() - x0.float()
    return (pred.float() - target).pow(2).flatten(1).mean(dim=1)


def dpo_logits(
    err_w: torch.Tensor, err_l: torch.Tensor, ref_err_w: torch.Tensor, ref_err_l: torch.Tensor, *, beta: float
) -> torch.Tensor:
    """z = −(β/2)·[(e_θʷ − e_refʷ) − (e_θˡ − e_refˡ)] per pair: positive when the policy improved the chosen
    sample's error more (or worsened it less) than the rejected one's, relative to the reference."""
    return -0.5 * beta * ((err_w - ref_err_w) - (err_l - ref_err_l))


def dpo_loss(z: torch.Tensor) -> torch.Tensor:
    """−log σ(z) per pair (log 2 at z = 0), computed stably."""
    return -F.logsigmoid(z)


def best_worst_pair(rewards: list[float], *, keep_zero_spread: bool) -> tuple[int, int, bool]:
    """(chosen, rejected, kept) within one prompt group's rewards.

    chosen = the highest reward, the FIRST such index on a tie; rejected = the lowest reward, the LAST such index on
    a tie. So a group whose rewards are all equal (zero spread) pairs its first sample against its last: two distinct
    samples (with at least two), trained as a preference only with `keep_zero_spread`; otherwise `kept` is False and
    the pair carries weight 0. A group of one sample is never kept (chosen = rejected)."""
    if not rewards:
        raise ValueError("a prompt group needs at least one sample")
    high, low = max(rewards), min(rewards)
    chosen = rewards.index(high)
    rejected = len(rewards) - 1 - rewards[::-1].index(low)
    kept = chosen != rejected and (high > low or keep_zero_spread)
    return chosen, rejected, kept
