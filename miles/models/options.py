"""Family options: run flags a model family reads (`--num-frames`, ...), each declared once with its type, range,
help and the families it applies to, and the parser group that adds them. Torch-free, so the parser adds every
built-in family's options without importing a family (a family module imports diffusers' pipelines, ~4 s of CPU)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.utils.ranges import AT_LEAST_0, AT_LEAST_1, Range


@dataclass(frozen=True)
class FamilyOption:
    """One family's run option: `name` is the keyword its constructor receives (and the key of `family_options`),
    `flag` the command-line flag that sets it (args dest: the flag's name with underscores), `help` what it means for
    `family`. Several families may declare the same flag; the parser adds it once, its help listing them.

    `added_by`: the parser group that adds a flag living beside peers of its own (None: `add_family_arguments`)."""

    family: str
    name: str
    flag: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    range: Range | None = None
    added_by: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


TRAINED_EXPERTS = ("both", "high-noise", "low-noise")

# Every built-in family's options, in the order their flags appear in --help.
FAMILY_OPTIONS: tuple[FamilyOption, ...] = (
    FamilyOption("wan", "num_frames", "--num-frames", "default 81, 4k + 1", int, range=AT_LEAST_1),
    FamilyOption("wan-i2v", "num_frames", "--num-frames", "default 81, 4k + 1", int, range=AT_LEAST_1),
    FamilyOption("hunyuan-video15", "num_frames", "--num-frames", "default 121, 4k + 1", int, range=AT_LEAST_1),
    FamilyOption("ltx2", "num_frames", "--num-frames", "default 121, 8k + 1", int, range=AT_LEAST_1),
    FamilyOption("wan", "trained_experts", "--wan-trained-experts", "text-to-video", choices=TRAINED_EXPERTS),
    FamilyOption("wan-i2v", "trained_experts", "--wan-trained-experts", "image-to-video", choices=TRAINED_EXPERTS),
    *(
        FamilyOption(
            family,
            "guidance_scale_2",
            "--diffusion-guidance-scale-2",
            "two experts: CFG scale of the low-noise expert's steps",
            float,
            range=AT_LEAST_0,
            added_by="rollout",  # beside --diffusion-guidance-scale in add_rollout_arguments
        )
        for family in ("wan", "wan-i2v")
    ),
    FamilyOption(
        "z-image",
        "cfg_normalization",
        "--z-image-cfg-normalization",
        "ZImagePipeline's cfg_normalization: with CFG (w > 1) each sample's guided prediction is scaled down to at "
        "most this factor times the norm of its conditional prediction; default 0, off",
        float,
        range=AT_LEAST_0,
    ),
    FamilyOption(
        "z-image",
        "cfg_truncation",
        "--z-image-cfg-truncation",
        "ZImagePipeline's cfg_truncation: steps whose 1 - σ exceeds it run the conditional branch alone (no CFG); "
        "default 1, every step guided",
        float,
        range=AT_LEAST_0,
    ),
)

# families whose VAE decodes in spatial tiles with --vae-tiling on (diffusers' `vae.enable_tiling()`)
VAE_TILING_FAMILIES = ("hunyuan-video15", "ltx2", "qwen-image", "qwen-image-edit", "qwen-image-edit-plus")
FAMILY_OPTIONS += tuple(
    FamilyOption(family, "vae_tiling", "--vae-tiling", "on or off, default off", choices=("on", "off"))
    for family in VAE_TILING_FAMILIES
)

# what a flag shared by several families means, before each family's own part of its help
FLAG_SUMMARIES = {
    "--vae-tiling": "Decode each sample in overlapping spatial tiles, blended (diffusers' vae.enable_tiling()): "
    "untiled, HunyuanVideo 1.5's VAE attention over every latent position of a 480p clip holds ~90 GB "
    "(docs/user-guide/memory.md); `--plan` offers it where the decode sets an engine's peak; tiled samples differ "
    "slightly from untiled ones",
    "--num-frames": "Frames per video sample of a video family",
    "--wan-trained-experts": "Two-expert Wan 2.2 folders: which experts train, the others frozen; default both, so "
    "every σ the trained steps visit is trained through the expert that sampled it",
}


def options_of(family: str) -> tuple[FamilyOption, ...]:
    """The options a built-in family declares (what its constructor accepts)."""
    return tuple(option for option in FAMILY_OPTIONS if option.family == family)


def families_of(flag: str) -> list[str]:
    """The built-in families that read `flag`."""
    return [option.family for option in FAMILY_OPTIONS if option.flag == flag]


def add_family_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add every built-in family's option flags: a flag several families share once, its help naming each family's
    meaning; one another group adds (`added_by`) is left to it. Their ranges: `family_option_ranges`."""
    by_flag: dict[str, list[FamilyOption]] = {}
    for option in FAMILY_OPTIONS:
        by_flag.setdefault(option.flag, []).append(option)
    for flag, options in by_flag.items():
        first = options[0]
        if any((o.type, o.choices, o.range, o.added_by) != (first.type, first.choices, first.range, first.added_by)
               for o in options):  # fmt: skip
            raise ValueError(f"{flag}: the families {families_of(flag)} declare it with different types or ranges")
        if first.added_by is not None:
            continue
        kwargs: dict[str, Any] = {"choices": first.choices} if first.choices else {"type": first.type}
        parser.add_argument(flag, default=None, help=_help(flag, options), **kwargs)


def family_option_ranges() -> dict[str, Range]:
    """Each family option's range by args dest, from its declaration (the parser checks the command line and
    `--config` against them, as every numeric flag)."""
    return {option.dest: option.range for option in FAMILY_OPTIONS if option.range is not None}


def _help(flag: str, options: list[FamilyOption]) -> str:
    """One family's help with its name, or the flag's summary with each family's part."""
    if len(options) == 1 and flag not in FLAG_SUMMARIES:
        return f"{options[0].help[0].upper()}{options[0].help[1:]} ({options[0].family} family)."
    parts = "; ".join(f"{o.family}: {o.help}" for o in options)
    return f"{FLAG_SUMMARIES[flag]} ({parts})." if flag in FLAG_SUMMARIES else f"{parts}."


def family_options(args: argparse.Namespace) -> dict[str, Any]:
    """The family options a run's flags set (those given, i.e. not None), for `get_train_pipeline_config`."""
    options = {}
    for option in FAMILY_OPTIONS:
        value = getattr(args, option.dest)
        if value is not None:
            options[option.name] = value
    return options


def option_flag(name: str) -> str:
    """The flag of the option `name` (the name itself when no built-in family declares it)."""
    return next((option.flag for option in FAMILY_OPTIONS if option.name == name), name)
