"""The start-up check of a real CUDA run: plan it first (seconds, before any weight is read) and refuse to start
when a GPU would run out of memory, naming the GPU, the role, the phase and the flags that fit (`--no-plan-check`
skips it)."""

from __future__ import annotations

import argparse
import logging

import torch

from miles.plan.command import gib, make_plan
from miles.plan.suggest import Change, apply_changes
from miles.utils.distributed import uses_gpu

logger = logging.getLogger(__name__)


class PlanDoesNotFit(ValueError):
    """The run's plan says a GPU would run out of memory."""


def local_gpu(args: argparse.Namespace) -> str:
    """`--plan-gpu` when given, else this machine's first GPU's size in GiB (the driver's node; the trainer's GPUs
    are alike in a homogeneous cluster)."""
    if args.plan_gpu != "h100-80gb" or not torch.cuda.is_available():
        return args.plan_gpu
    return f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.2f}"


def check_plan(args: argparse.Namespace) -> dict | None:
    """Plan a CUDA run before it starts; raises `PlanDoesNotFit` when it would not fit. None when not checked."""
    if args.no_plan_check or args.plan or not uses_gpu(args):
        return None
    planned = argparse.Namespace(**{**vars(args), "plan_gpu": local_gpu(args)})
    try:
        report = make_plan(planned)
    except Exception as exc:
        auto = " ".join(f"--{dest.replace('_', '-')}" for dest in args.auto_sizes)
        exc.add_note(
            "the start-up plan failed while simulating this run on fake tensors (a planner error, not one of the "
            "run: please report it with the command). --no-plan-check starts without it"
            + (f", giving {auto} yourself (the plan sizes them)" if auto else "")
        )
        raise
    worst = report["worst_gpu"]
    if report["auto"]["flags"]:  # the `auto` sizes the plan chose, for the run itself
        apply_changes(args, [Change(report["auto"]["flags"], report["auto"]["values"])])
        logger.info("plan: auto sizes %s", report["auto"]["flags"])
    if report["fits"]:
        logger.info(
            "plan: fits (%s on GPU %d in %s, of %s usable; planned in %.0fs)",
            gib(worst["peak_bytes"]),
            worst["index"],
            worst["phase"],
            gib(report["usable_bytes"]),
            report["plan_seconds"],
        )
        return report
    fixes = "; ".join(s["flags"] for s in report["suggestions"]) or "none of the tried changes: use more or larger GPUs"
    raise PlanDoesNotFit(
        f"this run would run out of GPU memory: GPU {worst['index']} ({', '.join(worst['roles'])}) needs "
        f"{gib(worst['peak_bytes'])} in {worst['phase']}, more than the {gib(report['usable_bytes'])} usable of "
        f"{report['gpu']}. Flags that fit: {fixes}. (`--plan` prints the whole plan; --no-plan-check skips this check)"
    )
