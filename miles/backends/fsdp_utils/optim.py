"""AdamW and the learning-rate schedule (constant, linear warm-up, linear or cosine decay)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from miles.arguments.records import FlagRecord


@dataclass(frozen=True)
class OptimizerFlags(FlagRecord):
    """The optimizer's and the schedule's flags (the peak LR is the role's setting, passed beside)."""

    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    weight_decay: float
    lr_warmup_steps: int
    lr_decay_steps: int | None  # None: decay over the run's optimizer steps
    lr_decay_style: str  # constant | linear | cosine
    min_lr: float


def lr_multiplier(step: int, *, warmup_steps: int, decay_steps: int, decay_style: str, min_ratio: float) -> float:
    """Multiplier of the peak LR after `step` optimizer steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_style == "constant":
        return 1.0
    progress = min(max(step - warmup_steps, 0) / max(decay_steps - warmup_steps, 1), 1.0)
    if decay_style == "linear":
        shape = 1.0 - progress
    elif decay_style == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"--lr-decay-style {decay_style!r}: expected constant, linear or cosine")
    return min_ratio + (1.0 - min_ratio) * shape


def build_optimizer(params: Iterable[torch.nn.Parameter], flags: OptimizerFlags, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=lr,
        betas=(flags.adam_beta1, flags.adam_beta2),
        eps=flags.adam_eps,
        weight_decay=flags.weight_decay,
        # one fused kernel per step (CPU and CUDA) instead of one op per parameter: torch picks the per-tensor
        # path on CPU by default, and on FSDP2's DTensors each of those ops pays a Python dispatch
        fused=True,
    )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, flags: OptimizerFlags, lr: float, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    decay_steps = flags.lr_decay_steps or total_steps
    fn: Callable[[int], float] = lambda step: lr_multiplier(  # noqa: E731
        step,
        warmup_steps=flags.lr_warmup_steps,
        decay_steps=decay_steps,
        decay_style=flags.lr_decay_style,
        min_ratio=flags.min_lr / lr,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def scale_learning_rate(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, factor: float
) -> None:
    """Every parameter group's learning rate and the schedule's base rates times `factor` (a rollback's lower LR,
    `--monitor-rollback-lr-factor`): the schedule goes on from its step with the lower peak (its floor, a ratio of
    the peak, with it), and a checkpoint saved later keeps the lower rates."""
    scheduler.base_lrs = [rate * factor for rate in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor
