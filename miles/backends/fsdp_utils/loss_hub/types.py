"""What the hooks see: the frozen rollout-level context, the prepared micro-batch and window metrics."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class DiffusionLossContext:
    """Read-only view shared by every hook of one `train` call; it carries no loop state.

    Per-call facts (micro-batch id, optimizer step index, the train-output list) travel as hook
    arguments so that a prepare running ahead of the loss cannot race on shared fields.
    """

    args: argparse.Namespace
    role: str
    rollout_id: int
    dp_rank: int
    dp_size: int
    device: torch.device
    forward_dtype: torch.dtype
    family: Any
    networks: Mapping[str, torch.nn.Module]


@dataclass(frozen=True)
class Guidance:
    """Classifier-free guidance for one forward: the scale, and the negative conditioning when the scale is > 1."""

    scale: float = 1.0
    negative: Any = None


@dataclass
class PreparedBatch:
    """Inputs of one micro-batch's forward. The trunk runs `policy` on them with grad, and without grad each frozen
    network named in `frozen_networks` (its prediction reaches the formula as `frozen_preds[name]`), with the batch's
    own guidance unless `frozen_guidance` gives that network another (e.g. a teacher scored with CFG).

    `unroll_sigmas` (a σ grid (K + 1,), K ≥ 1; the reward-gradient losses): the trunk runs the trained network as a
    differentiable Euler sampler from `latents` at unroll_sigmas[0] through the K steps, each step's activations
    checkpointed when K > 1 (`miles.diffusion.reward_grad.euler_unroll`); `new_pred` is then the first step's velocity and the
    formula also gets `unrolled`, the latents at unroll_sigmas[-1]. Frozen networks still run once, at `latents`."""

    latents: torch.Tensor
    sigmas: torch.Tensor
    embeds: Any
    negative: Any = None
    guidance_scale: float = 1.0
    frozen_networks: tuple[str, ...] = ()
    frozen_guidance: Mapping[str, Guidance] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    unroll_sigmas: torch.Tensor | None = None

    def guidance_of(self, name: str) -> Guidance:
        """The guidance of network `name`'s forward: its own from `frozen_guidance`, else the batch's."""
        return self.frozen_guidance.get(name, Guidance(self.guidance_scale, self.negative))


def frozen_prediction(frozen_preds: Mapping[str, torch.Tensor], name: str, needed_by: str) -> torch.Tensor:
    """`frozen_preds[name]`, or an error saying how to get it: the prepare names it and the role holds it."""
    if name not in frozen_preds:
        raise KeyError(
            f"{needed_by} needs the {name!r} network's prediction: its prepare must name {name!r} in "
            f"PreparedBatch.frozen_networks and the role must hold that network (got predictions of "
            f"{sorted(frozen_preds)})"
        )
    return frozen_preds[name]


class WindowMetrics:
    """Sums and counts of per-pair values within one window; reduced over dp ranks by the trunk. The sums stay on
    the values' device (float64 scalars, added as the host would add them) so that recording a value never waits
    for the device: the trunk moves them once per window."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, float] = {}

    def add(self, name: str, values: torch.Tensor | float) -> None:
        values = torch.as_tensor(values).detach()
        total = values.float().sum().to(torch.float64)
        self.sums[name] = total if name not in self.sums else self.sums[name] + total
        self.counts[name] = self.counts.get(name, 0.0) + values.numel()

    def totals(self, names: list[str]) -> torch.Tensor:
        """(len(names), 2) float64: each name's sum and count, on the sums' device."""
        sums = torch.stack([self.sums[n].to(self.sums[names[0]].device) for n in names])
        counts = torch.tensor([self.counts[n] for n in names], dtype=torch.float64, device=sums.device)
        return torch.stack([sums, counts], dim=1)

    def means(self) -> dict[str, float]:
        names = sorted(self.sums)
        if not names:
            return {}
        return {n: s / max(c, 1.0) for n, (s, c) in zip(names, self.totals(names).tolist())}


def conditioning_from_pairs(batch: dict[str, torch.Tensor], device: torch.device, prefix: str = "") -> Any:
    """The family's `Conditioning` stored in train pairs (`{prefix}cond/<name>` columns), on `device`."""
    from miles.models.conditioning import Conditioning  # here: `miles.models` imports diffusers (~5 s at start-up)

    return Conditioning.from_columns(batch, prefix).to(device)
