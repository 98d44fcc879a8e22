"""The miles driver (ARCHITECTURE §4): parse flags, start the groups, loop generate -> train -> save."""

# ruff: noqa: E402 - the command's start and the environment's defaults come before miles' imports
import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

COMMAND_STARTED = time.perf_counter()  # as a script: the command's start, less the interpreter's own (~0.05 s)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from miles.utils import import_gc

with import_gc.paused():  # the driver's imports (torch, Ray) without the collector (miles/utils/import_gc.py)
    from miles.algorithms import algorithm_of
    from miles.arguments.parser import parse_args
    from miles.plot import plot_run
    from miles.ray.cluster import check_cluster
    from miles.ray.generations import Generations
    from miles.ray.groups import RunGroups
    from miles.ray.monitor_guard import RunGuard
    from miles.ray.restarts import Restarts
    from miles.startup import start_up
    from miles.utils.console import ProgressLine, engine_progress_display, progress_bar, setup_logging, summary_line
    from miles.utils.failures import run_cleanup
    from miles.utils.stop_signals import EXIT_PREEMPTED, StopSignals, ignore_late_signals, stop_line
    from miles.utils.tracking import Tracking, current_records, first_compile_seconds, open_tracking, read_metrics

logger = logging.getLogger("miles.driver")


def is_due(rollout_id: int, interval: int | None, last: int) -> bool:
    return rollout_id == last or (interval is not None and (rollout_id + 1) % interval == 0)


def run_rollout(
    args: argparse.Namespace,
    rollout_id: int,
    run_groups: RunGroups,
    generations: Generations,
    writer: Tracking,
    started: float | None = None,
    stop: StopSignals | None = None,
    guard: RunGuard | None = None,
) -> dict | None:
    """One rollout: generate, train each group in order, save when due, sync weights, eval when due, the guard's
    action (`--monitor-action`); returns its record (the trainer windows' records are logged as they come).
    `started` (the command's start, perf_counter clock) comes with the first rollout only: its record holds
    `perf/startup_s`. A stop signal during the generation abandons the rollout (None: the resumed run regenerates
    it alike); after that it runs to its end (a train step is collective over the ranks)."""
    phases, last = run_groups.phases, args.num_rollout - 1
    t0 = time.perf_counter()
    data, rollout_metrics, generate_s = generations.get(rollout_id)
    if stop is not None and stop.requested:  # training it would delay the stop by the longest phase
        stop.abandoned = f"rollout {rollout_id} generated, not trained"
        return None
    t1 = time.perf_counter()
    if not args.debug_rollout_only:
        phases.to_train(rollout_id)
        peer = None
        for role in algorithm_of(args).role_names:  # training order: each group's boxes feed the next
            peer = run_groups.groups[role].train(rollout_id, data, peer)
    t2 = time.perf_counter()
    save_s = run_groups.save(rollout_id) if is_due(rollout_id, args.save_interval, last) else None  # ranks awake
    weight_sync_s = 0.0 if args.debug_rollout_only else run_groups.update_weights(rollout_id)
    records = run_groups.pop_metrics()
    for record in records:
        writer.log(record)
    rollout_record = {
        "rollout_id": rollout_id,
        "step": records[-1]["step"] if records else None,
        "perf/generate_total_s": generate_s,
        "perf/train_s": t2 - t1,
        "perf/weight_sync_s": weight_sync_s,
        **rollout_metrics,
        **({"perf/startup_s": t0 - started} if started is not None else {}),
        **({"perf/save_s": save_s} if save_s is not None else {}),
        **({"perf/colocate_swap_s": phases.pop_seconds()} if phases.enabled else {}),
    }
    if started is not None and args.compile != "off":
        rollout_record["perf/startup_compile_s"] = first_compile_seconds(rollout_record, records)
    if run_groups.evaluator is not None and is_due(rollout_id, args.eval_interval, last):
        rollout_record.update(run_groups.evaluate(rollout_id + 1))
        if guard is not None:
            guard.observe_eval(rollout_record)
    if guard is not None:
        rollout_record.update(guard.after_rollout(rollout_id, rollout_record))
    writer.log(rollout_record)
    rollout_record["_actor_losses"] = [r["train/loss"] for r in records if "train/loss" in r and r["role"] == "actor"]
    rollout_record["_train_records"] = records
    return rollout_record


def train_rollouts(
    args: argparse.Namespace,
    run_groups: RunGroups,
    writer: Tracking,
    start_rollout_id: int,
    summary: dict,
    started: float,
    stop: StopSignals | None = None,
    guard: RunGuard | None = None,
) -> int:
    """The outer loop (ARCHITECTURE §4) with a progress bar; `started` as in `run`. Returns the last rollout
    completed, which is `args.num_rollout - 1` unless a stop signal (`stop.requested`) or the guard (`guard.stopped`,
    then in `summary["guard_stopped"]`) ended the loop early."""
    bar = progress_bar(range(start_rollout_id, args.num_rollout), args)
    progress = ProgressLine(algorithm_of(args).progress_keys)
    run_groups.rollout_manager.show_engine_progress(engine_progress_display(bar, args.loss_type))
    generations = Generations(args, run_groups.rollout_manager)
    completed = start_rollout_id - 1
    try:
        for rollout_id in bar:
            first = rollout_id == start_rollout_id
            if first:
                logger.info("start-up: %.1fs from the command to the first rollout", time.perf_counter() - started)
            record = run_rollout(
                args, rollout_id, run_groups, generations, writer, started if first else None, stop, guard
            )
            if record is None:
                break
            completed = rollout_id
            summary["losses"] += record["_actor_losses"]
            train_records = record.pop("_train_records")
            summary.setdefault("rollouts", []).append(record)
            bar.set_postfix(progress.update([*train_records, record]))
            if guard is not None and guard.stopped:
                summary["guard_stopped"] = guard.stopped
                break
            if stop is not None and stop.requested:
                break
    finally:
        generations.close()
    return completed


def run(
    args: argparse.Namespace,
    before_shutdown: Callable[[dict], None] | None = None,
    *,
    started: float | None = None,
) -> dict:
    """Run the whole job; returns a summary (actor losses, wall time; `stopped`: the last line of a run a SIGTERM /
    SIGINT stopped early, `miles.utils.stop_signals`; `guard_stopped`: that of a run `--monitor-action` stopped).
    `before_shutdown(groups)` lets tools and tests inspect the live groups after the last rollout. `started`: the
    command's start on the perf_counter clock (default now), from which the first rollout's `perf/startup_s` counts.
    """
    started = time.perf_counter() if started is None else started
    summary: dict = {"losses": []}
    with StopSignals(args.stop_grace_s) as stop:  # a first signal stops at the next safe point, a third exits at once
        with import_gc.paused():  # the start-up's imports (diffusers, the families) without the collector
            startup = start_up(args)  # the checks on a thread while Ray starts: their errors come before any actor
        writer = restarts = None
        try:
            writer = open_tracking(args)
            check_cluster(args)
            restarts = Restarts(args)  # --max-restarts: the run's attempts and their groups
            attempt = partial(start_and_train, restarts, writer, summary, stop, startup)
            run_groups, completed = restarts.attempts(attempt, writer, summary, stop, started)
            if completed is None:  # --eval-only
                return summary
            if stop.requested and completed < args.num_rollout - 1:  # a signal in the last rollout lets the run end
                summary["stopped"] = stop_line(stop, completed, run_groups.save_on_stop(completed), args.save)
            else:
                if args.save_hf and run_groups.groups:
                    run_groups.save_hf(args.save_hf, args.num_rollout - 1)
                if before_shutdown is not None:
                    before_shutdown(run_groups.groups)
        finally:  # every step runs; a failing one does not hide the error that stopped the run
            steps = restarts.groups.shutdown_steps() if restarts is not None and restarts.groups is not None else []
            if writer is not None:
                steps.append(("closing metrics.jsonl", writer.close))
            run_cleanup([*steps, *startup.shutdown_steps()])
    summary["wall_s"] = time.perf_counter() - started
    if "stopped" in summary:  # the trackers are closed and the actors gone: the run's last line
        logger.warning(summary["stopped"])
        return summary
    summary["plot"] = plot_run(args.output_dir, args.loss_type)
    logger.info(summary_line(args, current_records(read_metrics(writer.path)), summary["wall_s"], summary["plot"]))
    if "guard_stopped" in summary:  # the run's last line: which monitor ended it, and with what values
        logger.warning("the guard stopped the run: %s", summary["guard_stopped"])
    return summary


def start_and_train(
    restarts: Restarts, writer: Tracking, summary: dict, stop: StopSignals, startup: Any, started: float
) -> tuple[RunGroups, int | None]:
    """One attempt (`Restarts.attempts` runs them): every actor starts at once (start waits for them all), the
    baseline eval (first attempt only), then the rollouts; returns the groups and the last rollout completed (None:
    --eval-only)."""
    args = restarts.args
    restarts.groups = run_groups = RunGroups.launch(args)
    start_rollout_id = run_groups.start()
    restarts.start_attempt(start_rollout_id)
    guard = RunGuard(args, run_groups, start_rollout_id)
    if restarts.count == 0:
        startup.log_phases(started)
        if run_groups.evaluator is not None and not args.no_eval_before_train:  # the baseline, before any update
            baseline = run_groups.evaluate(start_rollout_id)
            guard.observe_eval(baseline)
            writer.log({"rollout_id": start_rollout_id, "step": 0, **baseline})
        if args.eval_only:
            return run_groups, None
    if stop.requested:  # a signal during the start-up stops before the first rollout
        return run_groups, start_rollout_id - 1
    return run_groups, train_rollouts(args, run_groups, writer, start_rollout_id, summary, started, stop, guard)


def main(argv: Sequence[str] | None = None, started: float | None = None) -> int:
    """`started`: the command's start on the `time.perf_counter` clock (default now); see `run`."""
    started = time.perf_counter() if started is None else started
    args = parse_args(argv)
    setup_logging(args.output_dir, args.log_level, args.default_notes)
    if args.plan:  # no training, no Ray: the run simulated on fake tensors (miles/plan/)
        from miles.plan.command import plan_command  # local: the trainer's imports, only a plan needs them here

        return plan_command(args)
    summary = run(args, started=started)
    if "stopped" in summary:
        ignore_late_signals()  # saved and cleaned up: a scheduler's late signal must not replace exit code 75
        return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main(started=COMMAND_STARTED))
