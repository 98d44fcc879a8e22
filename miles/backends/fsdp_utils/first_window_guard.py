"""The first-window guard: before the run's first update the trainer recomputes the log-probs the engines recorded,
with the same weights and kernel, so the policy ratio is 1 and |train - rollout| log-prob ~0 up to the forward
dtype's rounding. Anything more is a train/rollout mismatch (other weights, kernel, dtype or pairing) that the loss
would quietly learn from; the run fails naming both numbers, or only warns with --allow-rollout-mismatch."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from miles.algorithms import FirstWindowMetrics

logger = logging.getLogger(__name__)

# Per --diffusion-forward-dtype, the largest |ratio - 1| and mean |train - rollout| log-prob (per-dim mean of the
# step's Gaussian log-density) accepted before the first update: ~100x what the tiny model measures (fp32 ~1e-7;
# bf16 2.5e-4 at dp 2 with CFG, tests/e2e/test_policy_loss.py), below one unit of the dtype's rounding at the scale
# of a log-prob change that an update makes (bf16 eps 7.8e-3, fp16 9.8e-4).
LOG_PROB_BOUNDS = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 2e-3}


class RolloutMismatchError(RuntimeError):
    """Before the first update the trainer does not reproduce the engines' log-probs."""


def check_first_window(
    record: Mapping[str, float],
    keys: FirstWindowMetrics,
    forward_dtype: str,
    *,
    allow_mismatch: bool,
    role: str,
    rollout_id: int,
) -> str | None:
    """Check window 0's reduced metrics `record`; returns the problem (logged as a warning with `allow_mismatch`),
    None when within the bound; raises `RolloutMismatchError` otherwise."""
    wanted = [key for key in (keys.ratio, keys.log_prob_abs_diff) if key is not None]
    absent = [key for key in wanted if key not in record]
    if absent:
        raise KeyError(
            f"the first-window guard reads {absent}, which the {role}'s first window did not record: the algorithm's "
            "`first_window_metrics` must name metrics its formula adds in window 0 (or be None)"
        )
    bound = LOG_PROB_BOUNDS[forward_dtype]
    ratio = float(record[keys.ratio])
    diff = None if keys.log_prob_abs_diff is None else float(record[keys.log_prob_abs_diff])
    if abs(ratio - 1.0) <= bound and (diff is None or diff <= bound):
        return None
    numbers = f"{keys.ratio} = {ratio!r}" + ("" if diff is None else f", {keys.log_prob_abs_diff} = {diff!r}")
    problem = (
        f"{role} rollout {rollout_id}, before the first update: {numbers}; with --diffusion-forward-dtype "
        f"{forward_dtype} the ratio must be 1 and the train/rollout log-prob gap at most {bound:g}. The trainer does "
        "not reproduce the engines' log-probs: check that the engines hold the trainer's weights and dtype, sample "
        "with the trainer's kernel (--diffusion-sde-type, --diffusion-noise-level) and that the saved or custom "
        "rollout data matches the model"
    )
    if not allow_mismatch:
        raise RolloutMismatchError(problem + " (--allow-rollout-mismatch only warns)")
    logger.warning("%s (continuing: --allow-rollout-mismatch)", problem)
    return problem
