"""What the planner's tests share: the tiny run's flags and the dp-2 plan, simulated once per session."""

from __future__ import annotations

from miles.arguments.parser import parse_args
from miles.plan.command import resolve_plan_checkpoint

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--eval-interval", "0"]


def plan_args(*flags: str):
    args = parse_args(["--plan", *SMALL, *flags])
    args.hf_checkpoint = resolve_plan_checkpoint(args.hf_checkpoint)
    return args
