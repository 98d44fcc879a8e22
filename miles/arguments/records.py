"""Typed records of the parsed flags: a module that reads more than a couple of flags declares a frozen dataclass of
exactly those, its fields named as the flags' dests, and builds it once with `from_args(args)` (after the rules and
computed defaults: the values the run uses). What reads the record reads typed attributes, and a field that names no
flag fails at once, not when a rare branch reads it."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

R = TypeVar("R", bound="FlagRecord")


class FlagRecord:
    """The base of a flag record: `@dataclass(frozen=True) class EvalFlags(FlagRecord): eval_seed: int ...`, then
    `EvalFlags.from_args(args)`. Plain values only, so a record pickles into a Ray actor as its fields do."""

    @classmethod
    def from_args(cls: type[R], args: argparse.Namespace) -> R:
        """The record of `args` (a parsed namespace, or `default_args(...)` in a test): each field its flag's value."""
        if not dataclasses.is_dataclass(cls):
            raise TypeError(
                f"{cls.__name__} is a FlagRecord but not a dataclass: decorate it with @dataclass(frozen=True)"
            )
        missing = [f.name for f in dataclasses.fields(cls) if not hasattr(args, f.name)]
        if missing:
            raise AttributeError(
                f"{cls.__name__}.from_args: the namespace has no flag {', '.join(missing)} (a field is named after its "
                "flag's dest; build the namespace with parse_args or default_args)"
            )
        values: dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        return cls(**values)


@dataclass(frozen=True)
class RolloutFlags(FlagRecord):
    """The flags the rollout manager (`miles.ray.rollout_manager`) reads itself; declared here, not beside it, as that
    file is at the 400-line limit. The hooks, the rollout entry, the steps and the reward workers it calls take the
    whole namespace (their contracts do) and get `RolloutManager.args`."""

    hf_checkpoint: str
    model_family: str
    resolution: int | None
    dp_size: int
    num_rollout: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    rollout_seed: int
    no_rollout_shuffle: bool
    rollout_num_engines: int
    rollout_gpus_per_engine: float
    rollout_micro_batch_size: int | str  # a size, or "auto" (the engine sizes it)
    diffusion_forward_dtype: str
    compile: str
    use_lora: bool
    rm_type: str | None
    custom_rm_path: str | None
    rm_url: list[str] | None
    rm_num_workers: int
    negative_prompt: str
    diffusion_guidance_scale: float
    monitor_image_drift: float
    monitor_norm_drift: float
    monitor_diversity_collapse: float
    generate_chunk_size: int
    dynamic_sampling_max_rounds: int
    image_grid_interval: int
    media_max_samples: int
    output_dir: str
    load_debug_rollout_data: str | None
    save_debug_rollout_data: str | None
