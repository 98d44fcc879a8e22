"""`python train_diffusion.py <flags> --plan`: plan the run, print the table and the verdict, write plan.json."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from miles.models.builtin import resolve_checkpoint
from miles.plan.auto import auto_start, resolve_auto_sizes
from miles.plan.copies import started_ranks
from miles.plan.gpus import gpu_spec
from miles.plan.report import build_report
from miles.plan.run import CollectiveMismatch, PlanSettings, check_collectives, planned_device, simulate
from miles.plan.suggest import Change, suggest, with_changes

logger = logging.getLogger(__name__)

CONFIGS = Path(__file__).parent / "configs"  # the published configs of real models (no weights), by hub id
EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 3


def shipped_config(hub_id: str) -> Path | None:
    """The shipped config folder of a hub id (`black-forest-labs/FLUX.1-dev`), or None."""
    folder = CONFIGS / hub_id.replace("/", "--")
    return folder if "/" in hub_id and (folder / "model_index.json").is_file() else None


def shipped_hub_ids() -> list[str]:
    return sorted(p.name.replace("--", "/", 1) for p in CONFIGS.glob("*--*") if (p / "model_index.json").is_file())


def resolve_plan_checkpoint(value: str | None) -> str | None:
    """A local folder as given, a `builtin:` name's folder, else a hub id's shipped configs; an unknown id names
    the ones shipped."""
    if value is None or os.path.isdir(value) or value.startswith("builtin:"):
        return resolve_checkpoint(value)
    folder = shipped_config(value)
    if folder is None:
        raise ValueError(
            f"--hf-checkpoint {value}: not a local folder, and miles ships no configs for it; --plan knows "
            f"{', '.join(shipped_hub_ids())} (or give a local pipeline folder: its configs are read, no weights)"
        )
    return str(folder)


def plan_settings(args: argparse.Namespace) -> PlanSettings:
    return PlanSettings(gpu_spec(args.plan_gpu), args.plan_tflops, args.plan_interconnect_gbps)


def make_plan(args: argparse.Namespace, *, suggestions: bool = True) -> dict[str, Any]:
    """The plan of `args` (a copy with the checkpoints resolved is simulated), with suggestions when it does not
    fit; raises `CollectiveMismatch` when the simulated ranks would hang."""
    args = argparse.Namespace(**vars(args))
    for dest in ("hf_checkpoint", "teacher_load", "critic_checkpoint"):
        if getattr(args, dest, None):
            setattr(args, dest, resolve_plan_checkpoint(getattr(args, dest)))
    with started_ranks():  # re-plans of the micro-batch start from copies of the first plan's ranks
        return _make_plan(args, suggestions)


def _make_plan(args: argparse.Namespace, suggestions: bool) -> dict[str, Any]:
    settings = plan_settings(args)
    start = auto_start(args)
    first = with_changes(args, start)
    simulation = simulate(first)
    check_collectives(simulation)
    report = build_report(first, simulation, settings)
    base_seconds = report["plan_seconds"]
    changes, report, simulation = resolve_auto_sizes(args, report, settings, build_report, simulation, start)
    report["base_seconds"] = base_seconds
    args = with_changes(args, changes)
    report["auto"] = {"flags": " ".join(c.flags for c in changes), "values": auto_values(changes)}
    report["device"] = planned_device(args)
    if suggestions and not report["fits"]:
        started = time.perf_counter()
        report["suggestions"] = suggest(args, report, settings, build_report, simulation)
        report["suggestions_seconds"] = round(time.perf_counter() - started, 1)
    return report


def auto_values(changes: list[Change]) -> dict[str, Any]:
    return {key: value for change in changes for key, value in change.values.items()}


def plan_command(args: argparse.Namespace) -> int:
    """Plan, print, write `--output-dir/plan.json`; the exit code says whether the run fits."""
    started = time.perf_counter()
    try:
        report = make_plan(args)
    except CollectiveMismatch as exc:
        logger.error("plan failed: %s", exc)
        return 1
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "plan.json")
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
    print(format_plan(args, report))  # noqa: T201 - the command's own output
    print(f"written: {path}")  # noqa: T201
    return EXIT_FITS if report["fits"] else EXIT_DOES_NOT_FIT


def gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def format_plan(args: argparse.Namespace, report: dict[str, Any]) -> str:
    lines = [
        f"plan: {args.hf_checkpoint}, --loss-type {args.loss_type}, {report['world_size']} GPU(s) "
        f"({report['device']}), against {report['gpu']} ({gib(report['gpu_memory_bytes'])}, "
        f"{gib(report['usable_bytes'])} usable)",
        "",
        f"{'role':<8} {'peak/GPU':>10} {'phase':<12} {'params':>10} {'grads':>10} {'optimizer':>10} "
        f"{'other':>10} {'activations':>12}",
    ]
    for name, role in report["roles"].items():
        lines.append(
            f"{name:<8} {gib(role['peak_bytes']):>10} {role['phase']:<12} {gib(role['params_bytes']):>10} "
            f"{gib(role['grads_bytes']):>10} {gib(role['optimizer_bytes']):>10} "
            f"{gib(role['other_state_bytes']):>10} {gib(role['activations_bytes']):>12}"
        )
    lines += ["", f"{'GPU':<5} {'peak':>10} {'phase':<12} holds"]
    for gpu in _distinct_gpus(report["gpus"]):
        lines.append(f"{gpu['index']:<5} {gib(gpu['peak_bytes']):>10} {gpu['phase']:<12} {', '.join(gpu['roles'])}")
    seconds = report["seconds_per_rollout"]
    flops = report["flops_per_sample"]
    lines += [
        "",
        f"host memory pinned per node: {gib(report['host_pinned_bytes_per_node'])}; weight sync per rollout: "
        f"{gib(report['sync_bytes_per_rollout'])}",
        f"FLOPs per sample: generate {flops['forward']:.3g}, train {flops['train']:.3g}",
        f"estimated seconds per rollout: generate {seconds['generate']:.1f}, train {seconds['train']:.1f}, sync "
        f"{seconds['sync']:.2f} (at {args.plan_tflops:g} TFLOP/s per GPU, {args.plan_interconnect_gbps:g} Gbit/s)",
        "",
        _verdict(report),
    ]
    if report["auto"]["flags"]:
        lines.insert(-1, f"auto sizes: {report['auto']['flags']} (the largest that fits, re-planned)")
    for suggestion in report["suggestions"]:
        lines.append(
            f"  fits with: {suggestion['flags']} (worst GPU {gib(suggestion['worst_gpu_peak_bytes'])} in "
            f"{suggestion['worst_gpu_phase']}; re-planned in {suggestion['plan_seconds']:.0f}s)"
        )
    lines.append(_timing(report))
    return "\n".join(lines)


def _timing(report: dict[str, Any]) -> str:
    """The plan's wall time, and what it was spent on (the first plan, the auto sizes' re-plans, the suggestions)."""
    parts = [f"first plan {report.get('base_seconds', report['plan_seconds']):.0f}s"]
    if report.get("auto_replans"):
        parts.append(f"{report['auto_replans']} re-plan(s) for the auto sizes {report['auto_seconds']:.0f}s")
    if "suggestions_seconds" in report:
        parts.append(f"suggestions {report['suggestions_seconds']:.0f}s")
    total = report.get("wall_seconds", report["plan_seconds"])
    return f"planned in {total:.0f}s ({', '.join(parts)})"


def _distinct_gpus(gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GPU 0, then the first GPU of each other kind of holder (the table stays short at 64 GPUs)."""
    seen, out = set(), []
    for gpu in gpus:
        kind = tuple(label.split(" rank")[0].split(" ")[0] for label in gpu["roles"])
        if gpu["index"] == 0 or kind not in seen:
            out.append(gpu)
        seen.add(kind)
    return out


def _verdict(report: dict[str, Any]) -> str:
    worst = report["worst_gpu"]
    where = (
        f"GPU {worst['index']} ({', '.join(worst['roles'])}) peaks at {gib(worst['peak_bytes'])} in {worst['phase']}"
    )
    if report["fits"]:
        return f"FITS: {where}, within {gib(report['usable_bytes'])} usable"
    tail = "; flags that fit:" if report["suggestions"] else "; no tried change fits (more GPUs, or a larger GPU)"
    return f"DOES NOT FIT: {where}, over {gib(report['usable_bytes'])} usable{tail}"
