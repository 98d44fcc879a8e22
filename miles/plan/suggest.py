"""When a plan does not fit: the cheapest flag changes that do, each simulated again (`simulate`), never guessed.
Changes are tried in order of what they cost a run (activation checkpointing, smaller micro-batches, LoRA, CPU
offload, more GPUs), one at a time, then added up until the plan fits."""

from __future__ import annotations

import argparse
import copy
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.models.base import family_options, get_train_pipeline_config
from miles.models.options import VAE_TILING_FAMILIES
from miles.plan.run import PlanSettings, Simulation, simulate
from miles.rollout.prompt_cache import AUTO, DEFAULT_SUBDIR, frees_text_encoders

logger = logging.getLogger(__name__)
MAX_REPLANS = 8  # simulations a search may run (a real-size one takes tens of seconds)


WINDOW = ("window",)  # a change of the trainer's window only: its phases after the window are the base plan's


@dataclass(frozen=True)
class Change:
    flags: str  # as the user types them
    values: dict[str, Any]  # args dest -> value
    parts: tuple[str, ...] = ("trainer",)  # what a re-plan simulates again (the rest is the base plan's; `WINDOW`)


def trainer_ladder(args: argparse.Namespace) -> list[Change]:
    """The trainer's changes, cheapest first; each step is tried on top of the ones before (a smaller micro-batch
    replaces a larger one)."""
    steps = []
    if not args.gradient_checkpointing:
        steps.append(Change("--gradient-checkpointing", {"gradient_checkpointing": True}, WINDOW))
    steps += [
        Change(f"--micro-batch-size {m}", {"micro_batch_size": m}, WINDOW) for m in _smaller(args.micro_batch_size)
    ]
    if not args.use_lora:
        steps.append(Change("--use-lora", {"use_lora": True}, ("engine", "trainer")))
    if not args.fsdp_cpu_offload and not args.colocate:
        steps.append(Change("--fsdp-cpu-offload", {"fsdp_cpu_offload": True}))
    return steps


def engine_ladder(args: argparse.Namespace, report: dict[str, Any]) -> list[Change]:
    """The engines' changes: a prompt cache that frees their text encoders where `auto` keeps them (a family whose
    prompts encode alone differently in the last bits: the samples are then not bit-identical to batch encoding),
    then smaller micro-batches."""
    steps = []
    family = get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args))
    cached = argparse.Namespace(**{**vars(args), "prompt_cache": os.path.join(args.output_dir, DEFAULT_SUBDIR)})
    if not frees_text_encoders(args, family) and args.prompt_cache == AUTO and frees_text_encoders(cached, family):
        steps.append(
            Change(f"--prompt-cache {cached.prompt_cache}", {"prompt_cache": cached.prompt_cache}, ("engine",))
        )
    if family.name in VAE_TILING_FAMILIES and args.vae_tiling != "on":  # a video's decode: its attention over it all
        steps.append(Change("--vae-tiling on", {"vae_tiling": "on"}, ("engine",)))
    rows = report["roles"].get("engine", {}).get("micro_batch", 1)
    steps += [
        Change(f"--rollout-micro-batch-size {r}", {"rollout_micro_batch_size": r}, ("engine",)) for r in _smaller(rows)
    ]
    return steps


def over(report: dict[str, Any], engines: bool) -> bool:
    """Whether a trainer GPU (`engines` False) or an engine-only GPU (True) overflows."""
    return side_peak(report, engines) > report["usable_bytes"]


def side_peak(report: dict[str, Any], engines: bool) -> int:
    """The largest peak of the trainer's GPUs (`engines` False: colocated engines included) or of the engine-only
    GPUs (True); 0 when the side has none."""
    peaks = [
        gpu["peak_bytes"]
        for gpu in report["gpus"]
        if all(label.startswith("engine") for label in gpu["roles"]) == engines
    ]
    return max(peaks, default=0)


def _smaller(value: int) -> list[int]:
    """A quarter of `value` and 1 (each re-plan costs a simulation: two sizes, not every halving)."""
    return sorted({max(1, value // 4), 1} - {value}, reverse=True)


def with_changes(args: argparse.Namespace, changes: list[Change]) -> argparse.Namespace:
    changed = copy.copy(args)
    apply_changes(changed, changes)
    return changed


def apply_changes(args: argparse.Namespace, changes: list[Change]) -> None:
    """`changes` made to `args` in place; a role's override that follows the shared flag (`role_followers`: not
    given) follows it, one the user gave stays."""
    for change in changes:
        vars(args).update(change.values)
        for key, value in change.values.items():
            for dest in args.role_followers:
                if dest.endswith(f"_{key}"):  # role overrides only: rollout_micro_batch_size is none
                    setattr(args, dest, value)


def suggest(
    args: argparse.Namespace,
    report: dict[str, Any],
    settings: PlanSettings,
    build_report: Callable[[argparse.Namespace, Any, PlanSettings], dict[str, Any]],
    base: Simulation,
) -> list[dict[str, Any]]:
    """The cheapest flag set that fits, re-planned (at most MAX_REPLANS simulations): the trainer's changes added one
    by one until its GPUs fit, then the engines' on top of them likewise (each plan holds every change so far, so a
    colocated GPU sees both). [] when no tried set fits."""
    budget = [MAX_REPLANS]
    chosen: list[Change] = []
    last = report
    for engines, ladder in ((False, trainer_ladder(args)), (True, engine_ladder(args, report))):
        if not over(report, engines):
            continue
        fixed = _climb(args, chosen, ladder, engines, settings, build_report, base, budget)  # plans every change
        if fixed is None:
            return []
        chosen, last = fixed
    return [_suggestion(chosen, last)] if chosen and last["fits"] else []


def _climb(
    args: argparse.Namespace,
    chosen: list[Change],
    ladder: list[Change],
    engines: bool,
    settings: PlanSettings,
    build_report: Callable,
    base: Simulation,
    budget: list[int],
) -> tuple[list[Change], dict[str, Any]] | None:
    """`chosen` plus the first prefix of `ladder` under which the side's GPUs fit, with its plan (None: none within
    the budget)."""
    steps = list(chosen)
    for change in ladder:
        if budget[0] <= 0:
            return None
        steps = [c for c in steps if not set(c.values) & set(change.values)] + [change]
        budget[0] -= 1
        replanned, _ = replan(args, steps, settings, build_report, base)
        if not over(replanned, engines):
            return steps, replanned
    return None


def replan(
    args: argparse.Namespace, changes: list[Change], settings: PlanSettings, build_report: Callable, base: Simulation
) -> tuple[dict[str, Any], Simulation]:
    """The plan with `changes` and its simulation, simulating again only what they touch (rank 0 only: the base plan
    checked the collectives)."""
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
    return report, simulation


def _suggestion(changes: list[Change], report: dict[str, Any]) -> dict[str, Any]:
    return {
        "flags": " ".join(c.flags for c in changes),
        "worst_gpu_peak_bytes": report["worst_gpu"]["peak_bytes"],
        "worst_gpu_phase": report["worst_gpu"]["phase"],
        "plan_seconds": report["plan_seconds"],
    }
