"""The valid range of every shared numeric flag, checked at parse time for the command line and `--config` alike;
an algorithm declares its own flags' ranges (`Algorithm.flag_ranges`), a role's overrides take the actor flag's."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """A closed or open interval; every float must also be finite (argparse's `float` accepts nan and inf)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '≥'} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '≤'} {self.high:g}"
        return "a finite number"


AT_LEAST_0, AT_LEAST_1, POSITIVE, FINITE = Range(0), Range(1), Range(0, low_open=True), Range()
UNIT, UNIT_OPEN_LOW, BETA = Range(0, 1), Range(0, 1, low_open=True), Range(0, 1, high_open=True)

# family options (--num-frames, ...) declare theirs (miles.models.options.family_option_ranges)
FLAG_RANGES: dict[str, Range] = {
    # cluster and model
    "dp_size": AT_LEAST_1, "sp_size": AT_LEAST_1, "fsdp_shard_size": AT_LEAST_1, "cpus_per_rank": POSITIVE, "gpus_per_rank": POSITIVE, "seed": AT_LEAST_0,
    "resolution": AT_LEAST_1,
    # optimizer and schedule
    "lr": POSITIVE, "min_lr": AT_LEAST_0, "lr_warmup_steps": AT_LEAST_0,
    "lr_decay_steps": AT_LEAST_1, "weight_decay": AT_LEAST_0, "adam_beta1": BETA, "adam_beta2": BETA,
    "adam_eps": POSITIVE, "clip_grad": AT_LEAST_0, "max_skipped_steps": AT_LEAST_1,
    # batches and steps
    "micro_batch_size": AT_LEAST_1, "global_batch_size": AT_LEAST_1, "num_steps_per_rollout": AT_LEAST_1,
    "num_rollout": AT_LEAST_1, "weight_sync_bucket_mb": AT_LEAST_1,
    "rollout_batch_size": AT_LEAST_1, "n_samples_per_prompt": AT_LEAST_1, "builtin_dataset_size": AT_LEAST_1,
    # sampling
    "rollout_seed": AT_LEAST_0, "diffusion_num_steps": AT_LEAST_1, "diffusion_guidance_scale": AT_LEAST_0,
    "rollout_num_engines": AT_LEAST_1, "rollout_cpus_per_engine": POSITIVE, "rollout_gpus_per_engine": POSITIVE,
    "rollout_startup_timeout": POSITIVE, "rollout_sync_timeout": POSITIVE,
    "diffusion_noise_level": AT_LEAST_0, "diffusion_num_sde_steps": AT_LEAST_0, "image_grid_interval": AT_LEAST_0,
    "media_max_samples": AT_LEAST_1, "mixgrpo_window_size": AT_LEAST_1, "mixgrpo_shift_interval": AT_LEAST_1,
    "mixgrpo_stride": AT_LEAST_0, "mixgrpo_flash_ratio": UNIT_OPEN_LOW,
    # rewards and rollout steps
    "rm_num_workers": AT_LEAST_0, "generate_chunk_size": AT_LEAST_0, "diffusion_adv_clip_max": POSITIVE,
    "dynamic_sampling_max_rounds": AT_LEAST_0, "ocr_num_threads": AT_LEAST_0,
    "rm_url_weight": FINITE, "rm_timeout": POSITIVE, "rm_retries": AT_LEAST_0, "rm_retry_backoff": AT_LEAST_0, "rm_batch_size": AT_LEAST_1,
    "rm_max_concurrency": AT_LEAST_1, "vlm_judge_max_score": POSITIVE, "vlm_judge_default_score": FINITE,
    "vlm_judge_frames": AT_LEAST_1, "vlm_judge_max_tokens": AT_LEAST_1, "vlm_judge_max_unparsable_frac": UNIT,
    "monitor_image_drift": AT_LEAST_0, "monitor_norm_drift": AT_LEAST_0, "monitor_diversity_collapse": UNIT,
    "monitor_rollback_lr_factor": UNIT_OPEN_LOW, "monitor_max_rollbacks": AT_LEAST_0, "monitor_gold_margin": AT_LEAST_0,
    "monitor_gold_window": AT_LEAST_1,
    # LoRA and EMA
    "lora_rank": AT_LEAST_1, "lora_alpha": POSITIVE, "ema_decay": UNIT, "ema_update_interval": AT_LEAST_1,
    # evaluation and checkpoints
    "eval_interval": AT_LEAST_0, "eval_num_prompts": AT_LEAST_1, "n_samples_per_eval_prompt": AT_LEAST_1,
    "diffusion_eval_num_steps": AT_LEAST_1, "eval_seed": AT_LEAST_0, "save_interval": AT_LEAST_1,
    "max_restarts": AT_LEAST_0, "restart_timeout": POSITIVE, "restart_min_dp_size": AT_LEAST_1,
    "stop_grace_s": POSITIVE,
    # the planner
    "plan_tflops": POSITIVE, "plan_interconnect_gbps": POSITIVE,
}  # fmt: skip


def range_violation(dest: str, value: Any, ranges: Mapping[str, Range] = FLAG_RANGES) -> str | None:
    """Why `value` is out of `dest`'s range in `ranges` (None when it is in range, None, or the flag has no range)."""
    bounds = ranges.get(dest)
    if isinstance(value, (list, tuple)):  # a flag given several times (action="append"): each value in range
        return next((p for v in value if (p := range_violation(dest, v, ranges))), None)
    if bounds is None or value is None or isinstance(value, (bool, str)) or bounds.contains(value):  # str: auto
        return None
    return f"--{dest.replace('_', '-')} must be {bounds.describe()}, got {value}"
