"""When a plan does not fit: the cheapest flag changes that do, each simulated again (`simulate`), never guessed.
Changes are tried in order of what they cost a run (activation checkpointing, smaller micro-batches, LoRA, CPU
offload, more GPUs), one at a time, then added up until the plan fits."""

from __future__ import annotations

import argparse
import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.plan.run import PlanSettings, Simulation, simulate

logger = logging.getLogger(__name__)
MAX_REPLANS = 8  # simulations a search may run (a real-size one takes tens of seconds)


@dataclass(frozen=True)
class Change:
    flags: str  # as the user types them
    values: dict[str, Any]  # args dest -> value
    parts: tuple[str, ...] = ("trainer",)  # what a re-plan simulates again (the rest is the base plan's)


def candidate_changes(args: argparse.Namespace, report: dict[str, Any]) -> list[Change]:
    """The changes worth trying for the GPUs that overflow (trainer ranks, engines, or both), cheapest first."""
    over = [g for g in report["gpus"] if g["peak_bytes"] > report["usable_bytes"]]
    trainer_bound = any(g["phase"] != "generate" for g in over)
    engine_bound = any(g["phase"] == "generate" for g in over)
    changes = []
    if trainer_bound:
        if not args.gradient_checkpointing:
            changes.append(Change("--gradient-checkpointing", {"gradient_checkpointing": True}))
        for micro in _smaller(args.micro_batch_size):
            changes.append(Change(f"--micro-batch-size {micro}", {"micro_batch_size": micro}))
        if not args.use_lora:
            changes.append(Change("--use-lora", {"use_lora": True}, ("engine", "trainer")))
        if not args.fsdp_cpu_offload and not args.colocate:
            changes.append(Change("--fsdp-cpu-offload", {"fsdp_cpu_offload": True}))
    if engine_bound:
        for rows in _smaller(report["roles"].get("engine", {}).get("micro_batch", 1)):
            flags = f"--rollout-micro-batch-size {rows}"
            changes.append(Change(flags, {"rollout_micro_batch_size": rows}, ("engine",)))
    changes.append(Change(f"--dp-size {args.dp_size * 2}", {"dp_size": args.dp_size * 2}, ("engine", "trainer")))
    return changes


def _smaller(value: int) -> list[int]:
    """A quarter of `value` and 1 (each re-plan costs a simulation: two sizes, not every halving)."""
    return sorted({max(1, value // 4), 1} - {value}, reverse=True)


def with_changes(args: argparse.Namespace, changes: list[Change]) -> argparse.Namespace:
    changed = copy.copy(args)
    for change in changes:
        vars(changed).update(change.values)
        for key, value in change.values.items():  # a role's own copy of an override follows the shared flag
            for role_key in [k for k in vars(changed) if k.endswith(f"_{key}") and k != key]:
                setattr(changed, role_key, value)
    return changed


def suggest(
    args: argparse.Namespace,
    report: dict[str, Any],
    settings: PlanSettings,
    build_report: Callable[[argparse.Namespace, Any, PlanSettings], dict[str, Any]],
    base: Simulation,
    *,
    limit: int = 3,
) -> list[dict[str, Any]]:
    """Up to `limit` flag sets that fit, each with its re-planned worst GPU and the seconds its plan took: single
    changes first (in cost order), then the cheapest changes added up one by one."""
    found: list[dict[str, Any]] = []
    tried_alone: list[tuple[Change, dict[str, Any]]] = []
    budget = MAX_REPLANS
    for change in candidate_changes(args, report)[: budget // 2]:
        replanned = _replan(args, [change], settings, build_report, base)
        tried_alone.append((change, replanned))
        if replanned["fits"]:
            found.append(_suggestion([change], replanned))
            if len(found) >= limit:
                return found
    if found:
        return found
    chosen: list[Change] = []
    for change, _ in sorted(tried_alone, key=lambda t: t[1]["worst_gpu"]["peak_bytes"])[: budget - len(tried_alone)]:
        chosen.append(change)
        replanned = _replan(args, chosen, settings, build_report, base)
        if replanned["fits"]:
            return [_suggestion(chosen, replanned)]
    return []


def _replan(
    args: argparse.Namespace, changes: list[Change], settings: PlanSettings, build_report: Callable, base: Simulation
) -> dict[str, Any]:
    """The plan with `changes`, simulating again only what they touch (rank 0 only: the base plan checked the
    collectives)."""
    changed = with_changes(args, changes)
    parts = tuple(dict.fromkeys(part for change in changes for part in change.parts))
    simulation = simulate(changed, ranks=[0], reuse=base, parts=parts)
    report = build_report(changed, simulation, settings)
    logger.info(
        "re-planned with %s: worst GPU %.1f GiB (%s), %.1fs",
        " ".join(c.flags for c in changes),
        report["worst_gpu"]["peak_bytes"] / 2**30,
        "fits" if report["fits"] else "does not fit",
        simulation.seconds,
    )
    return report


def _suggestion(changes: list[Change], report: dict[str, Any]) -> dict[str, Any]:
    return {
        "flags": " ".join(c.flags for c in changes),
        "worst_gpu_peak_bytes": report["worst_gpu"]["peak_bytes"],
        "worst_gpu_phase": report["worst_gpu"]["phase"],
        "plan_seconds": report["plan_seconds"],
    }
