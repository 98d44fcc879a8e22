"""Flags of sharding, precision and memory: activation checkpointing, master dtype, CPU offload, hybrid sharding,
deterministic mode; and their rules (checked by `validate_args` before any actor starts)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

DTYPE_CHOICES = ("fp32", "bf16", "fp16")
LOG_PROB_RATIO_LOSSES = ("policy_loss",)  # losses that compare trainer and engine log-probs (the PPO ratio)


def add_fsdp_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sharding, precision and memory")
    group.add_argument(
        "--diffusion-forward-dtype",
        default="fp32",
        choices=DTYPE_CHOICES,
        help="Dtype of every forward, trainer and rollout engines alike (FSDP2 param dtype; fp16 is refused).",
    )
    group.add_argument(
        "--fsdp-reduce-dtype", default="fp32", choices=DTYPE_CHOICES, help="FSDP gradient reduce dtype (not fp16)."
    )


def validate_fsdp_args(args: argparse.Namespace, fail: Callable[[str], None]) -> None:
    """The precision and sharding rules; `fail(message)` raises."""
    for dest in ("diffusion_forward_dtype", "fsdp_reduce_dtype"):
        if getattr(args, dest) == "fp16":
            fail(
                f"--{dest.replace('_', '-')} fp16 is not supported: fp16 gradients need a sharded gradient scaler, "
                "which miles does not have (small gradients would underflow to zero, silently); use bf16"
            )
    if (
        args.diffusion_forward_dtype != "fp32"
        and args.loss_type in LOG_PROB_RATIO_LOSSES
        and not args.diffusion_recompute_old_log_prob
    ):
        fail(
            f"--diffusion-forward-dtype {args.diffusion_forward_dtype} with --loss-type {args.loss_type} requires "
            "--diffusion-recompute-old-log-prob: the engines sample in the same dtype, but bf16 forwards differ by "
            "rounding between batch shapes and sharding (one bf16 ulp of the velocity, ~1e-4 in log-prob), which "
            "--diffusion-clip-range would clip; the recompute makes the first ratio exactly 1"
        )
