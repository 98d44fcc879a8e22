"""The `--rm-type` grammar (`name` or `name:weight,...`) and its consistency with `--custom-rm-path`.

It lives here, not in `rollout/rm_hub/`, so that argument validation checks a spec without importing the rollout
side; `rollout/rm_hub` maps the same names to the reward functions (a test keeps the two lists equal).
"""

from __future__ import annotations

import argparse
import importlib.util
import math

from miles.models.builtin import makes_video

CUSTOM = "custom"  # the reward loaded from --custom-rm-path
BUILTIN_REWARDS: tuple[str, ...] = (
    "shapes",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "clip_score",
    "pickscore",
    "ocr",
    "temporal_consistency",
    "motion_direction",
)

# Rewards whose model comes from an optional extra: (the module they import, how to install it).
REWARD_PACKAGES: dict[str, tuple[str, str]] = {"ocr": ("rapidocr_onnxruntime", "pip install miles[ocr]")}


def valid_reward_names() -> str:
    return ", ".join([*BUILTIN_REWARDS, CUSTOM])


def parse_reward_spec(text: str) -> list[tuple[str, float]]:
    """'shapes' -> [('shapes', 1.0)]; 'shapes:1.0,jpeg_compressibility:0.1' -> both, weighted. Weights are finite
    floats (negative and zero allowed: a zero-weight reward is still computed and logged)."""
    if not text or not text.strip():
        raise ValueError(f"--rm-type is empty; give a reward name or name:weight list from: {valid_reward_names()}")
    spec: list[tuple[str, float]] = []
    for item in text.split(","):
        name, sep, weight_text = item.strip().partition(":")
        name = name.strip()
        if name not in BUILTIN_REWARDS and name != CUSTOM:
            raise ValueError(f"--rm-type {text!r}: unknown reward {name!r}; valid rewards: {valid_reward_names()}")
        weight = 1.0
        if sep:
            try:
                weight = float(weight_text)
            except ValueError:
                weight = math.nan
            if not math.isfinite(weight):
                raise ValueError(
                    f"--rm-type {text!r}: weight {weight_text.strip()!r} of {name!r} is not a finite number"
                )
        if name in dict(spec):
            raise ValueError(f"--rm-type {text!r}: reward {name!r} is listed twice")
        spec.append((name, weight))
    return spec


def reward_spec_from_args(args: argparse.Namespace) -> list[tuple[str, float]]:
    """The spec of `--rm-type` (unset: `custom` with `--custom-rm-path`, else `shapes`, or `temporal_consistency` for
    a video family); a `--custom-rm-path` that the spec leaves out would be ignored silently, so it is an error."""
    custom_path = getattr(args, "custom_rm_path", None)
    video = makes_video(getattr(args, "hf_checkpoint", None), getattr(args, "model_family", "auto"))
    text = getattr(args, "rm_type", None) or (CUSTOM if custom_path else "temporal_consistency" if video else "shapes")
    spec = parse_reward_spec(text)
    names = [name for name, _ in spec]
    if CUSTOM in names and not custom_path:
        raise ValueError(f"--rm-type {text!r} names 'custom' but --custom-rm-path is not set")
    if custom_path and CUSTOM not in names:
        raise ValueError(
            f"--custom-rm-path is set but --rm-type {text!r} does not include 'custom'; use --rm-type custom "
            f"or weight it in, e.g. --rm-type custom:1.0,{names[0]}:0.5"
        )
    for name in names:
        if name in REWARD_PACKAGES and importlib.util.find_spec(REWARD_PACKAGES[name][0]) is None:
            module, install = REWARD_PACKAGES[name]
            raise ValueError(f"--rm-type {text!r}: reward {name!r} needs the {module} package: {install}")
    return spec
