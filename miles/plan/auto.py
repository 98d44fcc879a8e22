"""The `auto` sizes of a CUDA run: the largest the plan says fits, each chosen size re-planned (only the part it
touches).

- The trainer (`--micro-batch-size auto`, `--gradient-checkpointing auto`): the largest micro-batch, a power of two
  up to 32 (or the rank's whole window when smaller), without activation checkpointing; checkpointing only when no
  micro-batch fits without it, then the largest that fits with it. (Checkpointing costs about one more forward per
  step; a smaller micro-batch only splits the same work into smaller forwards.)
- The engines (`--rollout-micro-batch-size auto`): the positions rule's size (`miles.rollout.micro_batches`: enough
  rows to fill a GPU), lowered to the largest power of two that fits when it does not.

The first plan of an auto trainer is its smallest micro-batch without checkpointing (`auto_start`); the search
climbs from there (`climb`): the next size up is planned, and then only the sizes that a lower bound drawn from
two planned sizes leaves possible. At real size the smallest often fits and the next does not: one re-plan. On CPU,
`auto` is 32, off and the whole share (the parse's values, unchanged)."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.arguments.plan import CPU_MICRO_BATCH_SIZE
from miles.plan.run import PlanSettings, Simulation, planned_device
from miles.plan.suggest import WINDOW, Change, over, replan, side_peak, with_changes
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

    def replan(self, changes: list[Change]) -> tuple[dict[str, Any], Simulation]:
        """The plan with `changes` on top of `args`, simulating again only what they touch."""
        self.replans += 1
        return replan(self.args, changes, self.settings, self.build_report, self.base)

    def fits(self, changes: list[Change], engines: bool) -> tuple[dict[str, Any], Simulation] | None:
        """The plan with `changes`, when the side's GPUs (an engine-only GPU's when `engines`, else a trainer's)
        fit under it."""
        report, simulation = self.replan(changes)
        return None if over(report, engines) else (report, simulation)

    def choose(self, changes: list[Change], simulation: Simulation) -> None:
        self.chosen = merged(self.chosen, changes)
        self.args, self.base = with_changes(self.args, changes), simulation


def merged(first: list[Change], then: list[Change]) -> list[Change]:
    """`first` and `then`, a change of `then` replacing one of `first` that sets the same flags."""
    keys = {key for change in then for key in change.values}
    return [c for c in first if not set(c.values) & keys] + then


def auto_start(args: argparse.Namespace) -> list[Change]:
    """Where an `auto` trainer's search starts, which the first plan simulates: the smallest micro-batch, without
    checkpointing (the search climbs from there). [] on CPU, or when the flags give both sizes."""
    autos = set(args.auto_sizes)
    if planned_device(args) != "cuda":
        return []
    start = []
    if "gradient_checkpointing" in autos and args.gradient_checkpointing:
        start.append(Change("--gradient-checkpointing off", {"gradient_checkpointing": False}, WINDOW))
    if "micro_batch_size" in autos and args.micro_batch_size != 1:
        start.append(Change("--micro-batch-size 1", {"micro_batch_size": 1}, WINDOW))
    return start


def resolve_auto_sizes(
    args: argparse.Namespace,
    report: dict[str, Any],
    settings: PlanSettings,
    build_report: Callable[[argparse.Namespace, Simulation, PlanSettings], dict[str, Any]],
    base: Simulation,
    start: list[Change] | None = None,
) -> tuple[list[Change], dict[str, Any], Simulation]:
    """The changes the `auto` sizes (`args.auto_sizes`) resolve to on CUDA, with the plan and simulation under them.
    `report` and `base` are the plan of `args` with `start` (`auto_start`) applied. [] and the base plan on CPU;
    when no trainer size fits, the smallest tried (the suggestions take over from it)."""
    autos = set(args.auto_sizes)
    start = list(start or [])
    if not autos or planned_device(args) != "cuda":
        return start, report, base
    started = time.perf_counter()
    search = AutoSearch(with_changes(args, start), settings, build_report, base, chosen=start)
    simulation = base
    if autos & {"micro_batch_size", "gradient_checkpointing"}:
        changes, (report, simulation) = _trainer_sizes(search, autos, report)
        search.choose(changes, simulation)
    if "rollout_micro_batch_size" in autos and over(report, engines=True):
        found = _engine_size(search, simulation.engine_micro_batch)
        if found is not None:
            change, (report, simulation) = found
            search.choose([change], simulation)
    if search.replans:
        logger.info(
            "auto sizes: %s (the largest that fits; %d re-plans, %.0fs)",
            " ".join(c.flags for c in search.chosen),
            search.replans,
            time.perf_counter() - started,
        )
    report["auto_replans"] = search.replans
    report["auto_seconds"] = round(time.perf_counter() - started, 1)
    return search.chosen, report, simulation


def micro_batch_candidates(window_pairs: int) -> list[int]:
    """Powers of two up to 32, largest first, none above the rank's window (a larger one runs the same)."""
    sizes = {min(1 << k, window_pairs) for k in range(CPU_MICRO_BATCH_SIZE.bit_length())}
    return sorted((s for s in sizes if s >= 1), reverse=True)


Found = tuple[list[Change], tuple[dict[str, Any], Simulation]]


def _trainer_sizes(search: AutoSearch, autos: set[str], report: dict[str, Any]) -> Found:
    """The trainer's (checkpointing, micro-batch): the largest micro-batch that fits without checkpointing, else
    with it; when none fits, checkpointing at the smallest (the last tried). The search's base plan is the smallest
    micro-batch without checkpointing (`auto_start`) when both are auto."""
    args = search.args
    rounds = [args.gradient_checkpointing]
    if "gradient_checkpointing" in autos and args.compile != "full":  # --compile full cannot checkpoint
        rounds = [False, True]
    sizes = micro_batch_candidates(num_pairs(search.base.window))[::-1] if "micro_batch_size" in autos else []
    sizes = sizes or [args.micro_batch_size]
    base: Found = ([], (report, search.base))
    last = base
    for on in rounds:
        toggle = (
            []
            if on == args.gradient_checkpointing
            else [Change(CHECKPOINTING[on], {"gradient_checkpointing": on}, WINDOW)]
        )

        def measure(size: int, on: bool = on, toggle: list[Change] = toggle) -> tuple[int, Found]:
            nonlocal last
            if (size, on) == (args.micro_batch_size, args.gradient_checkpointing):
                return side_peak(report, engines=False), base
            changes = [*toggle, Change(f"--micro-batch-size {size}", {"micro_batch_size": size}, WINDOW)]
            last = (changes, search.replan(changes))
            return side_peak(last[1][0], engines=False), last

        best = climb(sizes, measure, report["usable_bytes"])
        if best is not None:
            return best
    return last


CHECKPOINTING = {True: "--gradient-checkpointing", False: "--gradient-checkpointing off"}


def climb(sizes: list[int], measure: Callable[[int], tuple[int, Any]], usable: int) -> Any:
    """What `measure` returned for the largest of `sizes` (ascending) whose measured peak is within `usable`, or
    None. Sizes are measured from the smallest up. A peak is the largest of the memory of every moment of the run,
    each a constant plus a multiple of the size (the same program on more rows), so it is convex in the size: once
    two sizes fit, the line through the two largest of them, extended, is below every larger size's peak. A size
    that line puts over `usable` is not measured; the climb jumps to the largest it leaves, and comes down one size
    at a time from an over one."""
    measured: dict[int, tuple[int, Any]] = {}
    fits: list[int] = []
    candidates = list(sizes)
    while candidates:
        size = candidates[0] if len(fits) < 2 else candidates[-1]
        measured[size] = measure(size)
        if measured[size][0] <= usable:
            fits.append(size)
            candidates = [c for c in candidates if c > size]
        else:
            candidates = [c for c in candidates if c < size]
        if len(fits) >= 2:
            a, b = sorted(fits)[-2:]
            slope = (measured[b][0] - measured[a][0]) / (b - a)
            candidates = [c for c in candidates if measured[b][0] + slope * (c - b) <= usable]
    return measured[max(fits)][1] if fits else None


def _engine_size(search: AutoSearch, rule_size: int) -> tuple[Change, tuple[dict[str, Any], Simulation]] | None:
    sizes = [1 << k for k in range(max(1, rule_size).bit_length()) if 1 << k < rule_size][::-1]

    def plan(size: int) -> Any:
        change = Change(f"--rollout-micro-batch-size {size}", {"rollout_micro_batch_size": size}, ("engine",))
        found = search.fits([change], engines=True)
        return None if found is None else (change, found)

    return largest(sizes, plan)


def largest(candidates: list[int], plan: Callable[[int], Any]) -> Any:
    """`plan(c)` of the largest of `candidates` (largest first) for which it is not None, by bisection: whether a
    candidate fits only gets likelier as candidates get smaller. None when none does."""
    low, high, best = 0, len(candidates) - 1, None
    while low <= high:
        middle = (low + high) // 2
        found = plan(candidates[middle])
        if found is not None:
            best, high = found, middle - 1
        else:
            low = middle + 1
    return best
