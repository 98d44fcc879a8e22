"""The rollout engines' deadlines and micro-batches: `--rollout-timeout` (parsed into `RolloutTimeout`),
`--rollout-startup-timeout`, `--rollout-sync-timeout` and `--rollout-micro-batch-size`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

AUTO = "auto"
DEFAULT_ROLLOUT_TIMEOUT = "60"
STEP_FLOOR_S = 600.0  # the least any engine step may take: the first one compiles (--compile) and encodes the prompts


@dataclass(frozen=True)
class RolloutTimeout:
    """How long an engine may take to generate. Per step (the default): after each progress report (a denoising
    step, the start of a micro-batch's decode) an engine has max(`per_step_per_sample_s` x the samples of its
    micro-batch, `floor_s`) seconds to send the next one, so a slow engine is waited for and a silent one is not.
    Total: the whole call must end within `total_s`, whatever it reports."""

    per_step_per_sample_s: float | None = float(DEFAULT_ROLLOUT_TIMEOUT)
    floor_s: float = STEP_FLOOR_S
    total_s: float | None = None

    def step_limit(self, samples: int) -> float:
        """Seconds allowed between two reports of an engine stepping `samples` samples at once (per-step mode)."""
        return max(self.floor_s, (self.per_step_per_sample_s or 0.0) * max(samples, 1))

    def describe(self) -> str:
        if self.total_s is not None:
            return f"--rollout-timeout total:{self.total_s:g} (seconds per generate call)"
        return (
            f"--rollout-timeout {self.per_step_per_sample_s:g} (seconds per denoising step per sample, at least "
            f"{self.floor_s:g}s per step)"
        )


def parse_rollout_timeout(text: str) -> RolloutTimeout:
    """`SECONDS` (per denoising step per sample) or `total:SECONDS` (per generate call), SECONDS > 0."""
    mode, _, value = text.rpartition(":")
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if mode not in ("", "total") or not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(
            f"--rollout-timeout {text!r}: give SECONDS (> 0, per denoising step per sample, e.g. 60) or "
            "total:SECONDS (per generate call, e.g. total:3600)"
        )
    return RolloutTimeout(total_s=seconds) if mode == "total" else RolloutTimeout(per_step_per_sample_s=seconds)


def parse_micro_batch_size(text: str) -> int | str:
    """`auto` or a whole number ≥ 1."""
    if text == AUTO:
        return AUTO
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"--rollout-micro-batch-size {text!r}: give auto or a whole number >= 1")
    return size


@dataclass(frozen=True)
class EngineTimeouts:
    """Every deadline of a rollout engine group: start-up (load the pipeline), weight sync / sleep / wake, generate."""

    startup_s: float = 1800.0
    sync_s: float = 600.0
    rollout: RolloutTimeout = RolloutTimeout()


def engine_timeouts(args: argparse.Namespace) -> EngineTimeouts:
    return EngineTimeouts(
        startup_s=args.rollout_startup_timeout, sync_s=args.rollout_sync_timeout, rollout=args.rollout_timeout
    )


def add_engine_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--rollout-micro-batch-size",
        type=parse_micro_batch_size,
        default=AUTO,
        help="Samples per transformer forward inside an engine (its share of the batch in micro-batches; with CFG the "
        "forward holds twice as many rows). Noise is drawn per sample: the same samples as one batch. auto: the whole "
        "share on CPU; on CUDA the most samples whose forward holds at most 2^18 latent positions, lowered by the "
        "start-up plan to the largest that fits (docs/user-guide/memory.md#auto-sizes).",
    )
    group.add_argument(
        "--rollout-timeout",
        type=parse_rollout_timeout,
        default=DEFAULT_ROLLOUT_TIMEOUT,  # a string default goes through `type`
        help="SECONDS: an engine must report its next denoising step within SECONDS x the samples of its "
        f"micro-batch (at least {STEP_FLOOR_S:g}s); a slow engine that reports is waited for. total:SECONDS: each "
        "generate call must end within SECONDS. Start-up and weight sync have their own deadlines.",
    )
    group.add_argument(
        "--rollout-startup-timeout",
        type=float,
        default=EngineTimeouts.startup_s,
        help="Seconds for the engines to load their pipelines.",
    )
    group.add_argument(
        "--rollout-sync-timeout",
        type=float,
        default=EngineTimeouts.sync_s,
        help="Seconds for an engine's weight sync, sleep or wake, counted again from each progress report of a "
        "generation it finishes first.",
    )
