"""The `auto` sizes of a CUDA run: the largest the plan says fits, each candidate re-planned (only the part it
touches), never extrapolated.

- The trainer (`--micro-batch-size auto`, `--gradient-checkpointing auto`): the largest micro-batch, a power of two
  up to 32 (or the rank's whole window when smaller), without activation checkpointing; checkpointing only when no
  micro-batch fits without it, then the largest that fits with it. (Checkpointing costs about one more forward per
  step; a smaller micro-batch only splits the same work into smaller forwards.)
- The engines (`--rollout-micro-batch-size auto`): the positions rule's size (`miles.rollout.micro_batches`: enough
  rows to fill a GPU), lowered to the largest power of two that fits when it does not.

Micro-batches are searched by bisection (memory grows with the micro-batch), so a search costs at most three
re-plans per setting; without checkpointing the smallest micro-batch is planned first (at real size it seldom fits:
one re-plan instead of three). On CPU, `auto` is 32, off and the whole share (the parse's values, unchanged)."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.arguments.plan import CPU_MICRO_BATCH_SIZE
from miles.plan.run import PlanSettings, Simulation, planned_device
from miles.plan.suggest import Change, over, replan, with_changes
from miles.utils.types import num_pairs

logger = logging.getLogger(__name__)


@dataclass
class AutoSearch:
    """One search: the flags and simulation it starts from (after the trainer's sizes are chosen, those), the
    changes chosen, and how many re-plans it ran."""

    args: argparse.Namespace
    settings: PlanSettings
    build_report: Callable[[argparse.Namespace, Simulation, PlanSettings], dict[str, Any]]
    base: Simulation
    chosen: list[Change] = field(default_factory=list)
    replans: int = 0

    def fits(self, changes: list[Change], engines: bool) -> tuple[dict[str, Any], Simulation] | None:
        """The plan with `changes` on top of `args` (simulating again only what they touch), when the side's GPUs
        (an engine-only GPU's when `engines`, else a trainer's) fit under it."""
        self.replans += 1
        report, simulation = replan(self.args, changes, self.settings, self.build_report, self.base)
        return None if over(report, engines) else (report, simulation)

    def choose(self, changes: list[Change], simulation: Simulation) -> None:
        self.chosen += changes
        self.args, self.base = with_changes(self.args, changes), simulation


def resolve_auto_sizes(
    args: argparse.Namespace,
    report: dict[str, Any],
    settings: PlanSettings,
    build_report: Callable[[argparse.Namespace, Simulation, PlanSettings], dict[str, Any]],
    base: Simulation,
) -> tuple[list[Change], dict[str, Any], Simulation]:
    """The changes the `auto` sizes (`args.auto_sizes`) resolve to on CUDA, with the plan and simulation under them
    ([] and the base plan when the base values fit, on CPU, or when no candidate fits: the suggestions take over)."""
    autos = set(args.auto_sizes)
    if not autos or planned_device(args) != "cuda":
        return [], report, base
    started = time.perf_counter()
    search = AutoSearch(args, settings, build_report, base)
    simulation = base
    if autos & {"micro_batch_size", "gradient_checkpointing"} and over(report, engines=False):
        found = _trainer_sizes(search, autos)
        if found is not None:
            changes, (report, simulation) = found
            search.choose(changes, simulation)
    if "rollout_micro_batch_size" in autos and over(report, engines=True):
        found = _engine_size(search, simulation.engine_micro_batch)
        if found is not None:
            change, (report, simulation) = found
            search.choose([change], simulation)
    if search.chosen:
        logger.info(
            "auto sizes: %s (the largest that fits; %d re-plans, %.0fs)",
            " ".join(c.flags for c in search.chosen),
            search.replans,
            time.perf_counter() - started,
        )
    return search.chosen, report, simulation


def micro_batch_candidates(window_pairs: int) -> list[int]:
    """Powers of two up to 32, largest first, none above the rank's window (a larger one runs the same)."""
    sizes = {min(1 << k, window_pairs) for k in range(CPU_MICRO_BATCH_SIZE.bit_length())}
    return sorted((s for s in sizes if s >= 1), reverse=True)


def _trainer_sizes(
    search: AutoSearch, autos: set[str]
) -> tuple[list[Change], tuple[dict[str, Any], Simulation]] | None:
    args = search.args
    checkpointing = [args.gradient_checkpointing]
    if "gradient_checkpointing" in autos and args.compile != "full":  # --compile full cannot checkpoint
        checkpointing = [False, True]
    if "micro_batch_size" in autos:
        sizes = micro_batch_candidates(num_pairs(search.base.window))
    else:
        sizes = [args.micro_batch_size]
    base_key = (min(args.micro_batch_size, sizes[0]), args.gradient_checkpointing)  # the base plan: over
    for on in checkpointing:
        toggle = (
            []
            if on == args.gradient_checkpointing
            else [Change("--gradient-checkpointing", {"gradient_checkpointing": on})]
        )

        def plan(size: int, on: bool = on, toggle: list[Change] = toggle) -> Any:
            if (size, on) == base_key:
                return None
            change = Change(f"--micro-batch-size {size}", {"micro_batch_size": size})
            found = search.fits([*toggle, change], engines=False)
            return None if found is None else ([*toggle, change], found)

        # a checkpointing round follows: the smallest micro-batch first (at real size it rarely fits without
        # checkpointing, and then one re-plan says so instead of a bisection's three)
        best = largest(sizes, plan, smallest_first=on is False and len(checkpointing) > 1)
        if best is not None:
            return best
    return None


def _engine_size(search: AutoSearch, rule_size: int) -> tuple[Change, tuple[dict[str, Any], Simulation]] | None:
    sizes = [1 << k for k in range(max(1, rule_size).bit_length()) if 1 << k < rule_size][::-1]

    def plan(size: int) -> Any:
        change = Change(f"--rollout-micro-batch-size {size}", {"rollout_micro_batch_size": size}, ("engine",))
        found = search.fits([change], engines=True)
        return None if found is None else (change, found)

    return largest(sizes, plan)


def largest(candidates: list[int], plan: Callable[[int], Any], smallest_first: bool = False) -> Any:
    """`plan(c)` of the largest of `candidates` (largest first) for which it is not None, by bisection: whether a
    candidate fits only gets likelier as candidates get smaller. None when none does. `smallest_first`: plan the
    smallest first, and bisect the others only when it fits."""
    low, high, best = 0, len(candidates) - 1, None
    if smallest_first and candidates:
        best = plan(candidates[-1])
        if best is None:
            return None
        high -= 1
    while low <= high:
        middle = (low + high) // 2
        found = plan(candidates[middle])
        if found is not None:
            best, high = found, middle - 1
        else:
            low = middle + 1
    return best
