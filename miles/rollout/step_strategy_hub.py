"""Step strategies: which of the sampling steps are stochastic (SDE) and trained; the rest run the `ode` kernel
(or, under MixGRPO-Flash, DPM-Solver++ after the window).

The final step (tiny σ') is never trained. Choices are a pure function of (args, rollout_id), so every engine
and every rank agree without talking; MixGRPO's window counter k is the rollout id.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from miles.arguments.records import FlagRecord
from miles.utils.misc import load_function
from miles.utils.seeding import stream_rng

logger = logging.getLogger(__name__)

# Mixed into the window's seed so its draws are independent of the other (rollout_seed, rollout_id) streams.
_WINDOW_STREAM = 0x5DE
_MIXGRPO_STREAM = 0x313C

# MixGRPO's shift interval τ when --mixgrpo-shift-interval is not given (the authors' FLUX scripts: 25, Flash 20).
MIXGRPO_SHIFT_INTERVAL, MIXGRPO_FLASH_SHIFT_INTERVAL = 25, 20


@dataclass(frozen=True)
class StepFlags(FlagRecord):
    """The flags the step strategies read (`miles.arguments.rl`: the sampling group and MixGRPO's)."""

    diffusion_num_steps: int
    diffusion_num_sde_steps: int | None  # None or 0: every step but the last
    diffusion_sde_window_range: str | Sequence[int] | None  # "a,b" (a config file may give a pair)
    diffusion_step_strategy_path: str | None
    rollout_seed: int
    mixgrpo_window_size: int | None
    mixgrpo_mode: str  # "progressive" or "random"
    mixgrpo_shift_interval: int | None  # None: the authors' default (MIXGRPO_SHIFT_INTERVAL, Flash's)
    mixgrpo_stride: int
    mixgrpo_flash: bool
    mixgrpo_flash_ratio: float


def select_trained_steps(args: argparse.Namespace, rollout_id: int) -> list[int]:
    """The sorted step indices (in [0, num_steps - 2]) that sample with the SDE kernel and are trained."""
    flags = StepFlags.from_args(args)
    num_steps = flags.diffusion_num_steps
    if num_steps < 1:
        raise ValueError(f"--diffusion-num-steps must be >= 1, got {num_steps}")
    path = flags.diffusion_step_strategy_path
    num_sde_steps = flags.diffusion_num_sde_steps
    window_range = flags.diffusion_sde_window_range
    if flags.mixgrpo_window_size:
        if path or window_range is not None:
            raise ValueError(
                "--mixgrpo-window-size chooses the trained steps itself; do not combine it with "
                "--diffusion-step-strategy-path or --diffusion-sde-window-range"
            )
        return mixgrpo_steps(flags, flags.mixgrpo_window_size, rollout_id, num_steps)
    if path:  # the user's strategy replaces the window (whose K has a default)
        if window_range is not None:
            raise ValueError(
                "--diffusion-step-strategy-path replaces the built-in strategies; do not combine it with "
                "--diffusion-sde-window-range"
            )
        return custom_steps(args, rollout_id, num_steps, path)
    if not num_sde_steps:
        if window_range is not None:
            raise ValueError(
                "--diffusion-sde-window-range needs --diffusion-num-sde-steps (the window length K to place in it)"
            )
        return all_but_last(num_steps)
    start, end = parse_window_range(window_range, num_steps)
    return window_steps(num_steps, num_sde_steps, start, end, seed=flags.rollout_seed, rollout_id=rollout_id)


def all_but_last(num_steps: int) -> list[int]:
    """Steps 0 .. num_steps - 2: every step but the final one."""
    return list(range(num_steps - 1))


def parse_window_range(value: str | Sequence[int] | None, num_steps: int) -> tuple[int, int]:
    """`--diffusion-sde-window-range "a,b"` (or a pair) as ints; default (0, num_steps - 1)."""
    if value is None:
        return 0, num_steps - 1
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        start, end = (int(str(p).strip()) for p in parts)
    except ValueError as exc:
        raise ValueError(f"--diffusion-sde-window-range must be two integers 'a,b', got {value!r}") from exc
    return start, end


def window_steps(num_steps: int, num_sde_steps: int, start: int, end: int, *, seed: int, rollout_id: int) -> list[int]:
    """A contiguous window of `num_sde_steps` steps inside [start, end), its first step drawn uniformly in
    [start, end - num_sde_steps] from (seed, rollout_id)."""
    if not 1 <= num_sde_steps <= num_steps - 1:
        raise ValueError(
            f"--diffusion-num-sde-steps {num_sde_steps} must be in [1, {num_steps - 1}] "
            f"(the last of --diffusion-num-steps {num_steps} steps is never trained)"
        )
    if not 0 <= start < end <= num_steps - 1:
        raise ValueError(
            f"--diffusion-sde-window-range {start},{end} must satisfy 0 <= a < b <= {num_steps - 1} "
            f"(b is exclusive; the last of --diffusion-num-steps {num_steps} steps is never trained)"
        )
    if end - start < num_sde_steps:
        raise ValueError(
            f"--diffusion-num-sde-steps {num_sde_steps} does not fit in --diffusion-sde-window-range {start},{end} "
            f"({end - start} steps); widen the range or lower the count"
        )
    rng = stream_rng(seed, rollout_id, _WINDOW_STREAM)
    first = int(rng.integers(start, end - num_sde_steps + 1))
    return list(range(first, first + num_sde_steps))


def mixgrpo_steps(flags: StepFlags, window: int, rollout_id: int, num_steps: int) -> list[int]:
    """MixGRPO's sliding SDE window W_k of `window` steps (--mixgrpo-window-size) for rollout k = `rollout_id`, from
    the --mixgrpo-* flags."""
    interval = flags.mixgrpo_shift_interval
    if interval is None:
        interval = MIXGRPO_FLASH_SHIFT_INTERVAL if flags.mixgrpo_flash else MIXGRPO_SHIFT_INTERVAL
    start = mixgrpo_window_start(
        num_steps,
        window,
        rollout_id,
        mode=flags.mixgrpo_mode,
        shift_interval=interval,
        stride=flags.mixgrpo_stride,
        seed=flags.rollout_seed,
    )
    return list(range(start, start + window))


def mixgrpo_window_start(
    num_steps: int, window: int, k: int, *, mode: str, shift_interval: int, stride: int, seed: int
) -> int:
    """The window's first step: progressive start_k = stride·(⌊k/τ⌋ mod (⌊max_t/stride⌋ + 1)) (it rolls back to 0;
    stride 0 keeps it at 0, the authors' Flash*), random start_k ~ U{0 .. max_t − w} from (seed, k); max_t = N − 2,
    and start ≤ max_t − w so that the window never holds step N − 2 or N − 1."""
    max_t = num_steps - 2
    if not 1 <= window <= max_t:
        raise ValueError(
            f"--mixgrpo-window-size {window} must be in [1, {max_t}] (--diffusion-num-steps {num_steps} - 2: the "
            "window never holds the last two steps)"
        )
    if mode == "random":
        return int(stream_rng(seed, k, _MIXGRPO_STREAM).integers(0, max_t - window + 1))
    if mode != "progressive":
        raise ValueError(f"--mixgrpo-mode must be progressive or random, got {mode!r}")
    positions = max_t // stride + 1 if stride else 1
    return min(stride * ((k // shift_interval) % positions), max_t - window)


def flash_ratio(args: argparse.Namespace) -> float | None:
    """--mixgrpo-flash-ratio when MixGRPO-Flash is on (the engine then runs DPM-Solver++ after the window), else None."""
    flags = StepFlags.from_args(args)
    if flags.mixgrpo_window_size and flags.mixgrpo_flash:
        return flags.mixgrpo_flash_ratio
    return None


def custom_steps(args: argparse.Namespace, rollout_id: int, num_steps: int, path: str) -> list[int]:
    """`fn(args, rollout_id, num_steps) -> list[int]` from `--diffusion-step-strategy-path`, validated."""
    steps = load_function(path)(args, rollout_id, num_steps)
    where = f"--diffusion-step-strategy-path {path!r} (rollout {rollout_id}, {num_steps} steps)"
    if not isinstance(steps, (list, tuple)) or not all(
        isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in steps
    ):
        raise ValueError(f"{where} must return a list of ints, got {steps!r}")
    steps = [int(s) for s in steps]
    if steps != sorted(set(steps)):
        raise ValueError(f"{where} must return sorted, unique step indices, got {steps}")
    if steps and (steps[0] < 0 or steps[-1] > num_steps - 2):
        raise ValueError(
            f"{where} returned {steps}: indices must be in [0, {num_steps - 2}] (the last step is never trained)"
        )
    return steps
