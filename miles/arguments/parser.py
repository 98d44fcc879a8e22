"""Command-line arguments: the shared argparse groups, every registered algorithm's own flags and its roles'
overrides, `--config` and `--algorithm-path` read in a first pass; the rules and computed defaults are in
rules.py (`validate_args`, then `derive_args`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import Any

from miles.algorithms import ALGORITHMS, BUILTIN_ALGORITHMS, DEFAULT_LOSS_TYPE, Algorithm
from miles.algorithms.roles import add_role_arguments
from miles.arguments.checkpoints import add_checkpoint_arguments
from miles.arguments.config_file import config_defaults, dest_of, read_config
from miles.arguments.evaluation import add_eval_arguments
from miles.arguments.flag_readers import (
    WITH_FIRST_WINDOW_GUARD,
    WITH_POLICY_RATIO,
    ByFlag,
    ReadBy,
    given_dests,
    mark_owned,
    unread_flags,
)
from miles.arguments.fsdp import add_fsdp_arguments
from miles.arguments.plan import AUTO, add_plan_arguments, parse_auto_size
from miles.arguments.rl import RL_ARGUMENT_GROUPS
from miles.arguments.rules import ArgumentError, derive_args, flag_ranges, validate_args
from miles.models.options import add_family_arguments
from miles.models.registry import BUILTIN_FAMILIES
from miles.utils.misc import HookLoadError, load_module
from miles.weight_sync.arguments import add_weight_sync_arguments

__all__ = ["ArgumentError", "build_parser", "derive_args", "parse_args", "validate_args"]
PROG = "train_diffusion.py"
CFG_FREE = ", ".join(
    f"{a.name} {a.guidance_scale:g}" for a in BUILTIN_ALGORITHMS if a.guidance_scale != Algorithm.guidance_scale
)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--ray-address", default=None, help="Ray cluster address; default starts a local one.")
    group.add_argument(
        "--dp-size",
        type=int,
        default=2,
        help="Data-parallel ranks per trained role (each a group of --sp-size Ray actors).",
    )
    group.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda when the Ray cluster has GPUs (with --ray-address: the cluster's, not the driver's node), "
        "else cpu.",
    )
    group.add_argument("--cpus-per-rank", type=float, default=0.5, help="CPU share of each trainer actor on CPU.")
    group.add_argument(
        "--cpu-phase-threads",
        choices=("auto", "off"),
        default="auto",
        help="auto: on CPU, rollout engines and trainer ranks that share a node take turns on all its cores: an "
        "engine generates with the node's cores (split among its engines), a rank trains with them (split among its "
        "group's ranks there), each back to its base count after. off: every actor keeps round(its CPU share) "
        "threads (thread counts change float bits at the 1e-8 level).",
    )
    group.add_argument(
        "--prefetch-microbatches",
        choices=("auto", "on", "off"),
        default="auto",
        help="Prepare micro-batch n+1 (the prepare hook, host-to-device copies on a side stream) on a worker thread "
        "while micro-batch n runs forward and backward; same hook calls, bit-identical results. auto: on for CUDA, "
        "off on CPU (where the prepare is a few slices and the thread would compete with the forward's).",
    )
    group.add_argument("--gpus-per-rank", type=float, default=1.0, help="GPUs per trainer actor on CUDA.")
    group.add_argument(
        "--colocate",
        action="store_true",
        help="Trainer ranks and rollout engines share devices: one placement group of --dp-size bundles, each one "
        "whole GPU; bundle i holds rank i of every trained group and engines i, i + dp-size, ..., each with an equal "
        "share of its GPU (--gpus-per-rank and --rollout-gpus-per-engine do not apply). Needs --dp-size GPUs.",
    )
    group.add_argument(
        "--colocate-sleep",
        choices=("auto", "on", "off"),
        default="auto",
        help="Rollout engines and trainer ranks that share a GPU take turns holding its memory: the trainer ranks "
        "move weights, optimizer state and shadows to host memory while the engines generate, the engines move "
        "their networks there (dropping the trained weights the next sync replaces) while the ranks train. auto: "
        "on when an engine and a trainer rank share a GPU (--colocate) "
        "and --async-rollout is off. on: always (on CPU the same steps run and save nothing: for tests). Bit-"
        "identical results.",
    )
    group.add_argument("--seed", type=int, default=1234, help="Seed of model init, noise and shuffling.")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--hf-checkpoint",
        default="builtin:tiny-shapes",
        help="Local diffusers pipeline folder (never downloaded); builtin:tiny-shapes is the shipped shapes model.",
    )
    group.add_argument(
        "--model-family",
        default="auto",
        help="Model family (auto: from model_index.json's _class_name); built in: "
        + ", ".join(f"{name} ({entry.pipeline_class_name})" for name, entry in sorted(BUILTIN_FAMILIES.items()))
        + ".",
    )
    group.add_argument(
        "--train-pipeline-config-path",
        default=None,
        help="Your own model family: file.py:Class or package.module.Class, a TrainPipelineConfig subclass "
        "(loaded in every process; docs/user-guide/customization.md).",
    )
    group.add_argument(
        "--teacher-load", default=None, help="Frozen teacher (diffusers pipeline or transformer folder)."
    )
    group.add_argument("--resolution", type=int, default=None, help="Image side in pixels (default: the model's).")
    add_family_arguments(group)  # the families' own options (--num-frames, ...), declared in miles/models/options.py


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("train")
    group.add_argument(
        "--loss-type",
        default=DEFAULT_LOSS_TYPE,
        help=f"The algorithm (ARCHITECTURE §1): {', '.join(a.name for a in BUILTIN_ALGORITHMS)}, or one an "
        "--algorithm-path module declares.",
    )
    group.add_argument(
        "--algorithm-path",
        default=None,
        help="A module or file.py imported in every process first (by the parser, before it reads the other "
        "flags): it declares new algorithms, with their flags, rules and roles, and registers their loss hub and "
        "rollout hub entries (docs/user-guide/customization.md).",
    )
    group.add_argument("--lr", type=float, default=1e-4, help="Peak learning rate (AdamW).")
    group.add_argument(
        "--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant", help="After warm-up."
    )
    group.add_argument("--lr-warmup-steps", type=int, default=0, help="Linear warm-up, in optimizer steps.")
    group.add_argument(
        "--lr-decay-steps", type=int, default=None, help="Decay length in optimizer steps (default: the whole run)."
    )
    group.add_argument("--min-lr", type=float, default=0.0, help="Floor of linear/cosine decay.")
    group.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay.")
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--clip-grad", type=float, default=1.0, help="Max gradient norm; 0 disables clipping.")
    group.add_argument(
        "--max-skipped-steps",
        type=int,
        default=3,
        help="Stop after this many consecutive optimizer steps skipped for a non-finite loss or gradient norm.",
    )
    ReadBy(group, WITH_FIRST_WINDOW_GUARD).add_argument(
        "--allow-rollout-mismatch",
        action="store_true",
        help="Only warn when, before the first update, the policy ratio is not 1 or train/log_prob_abs_diff is over "
        "the forward dtype's bound (losses with a policy ratio; default: the run fails naming both numbers).",
    )
    group.add_argument(
        "--micro-batch-size",
        type=parse_auto_size,
        default=AUTO,
        help="Train pairs per forward/backward. auto: 32 on CPU; on CUDA the largest (a power of two up to 32) that "
        "the start-up plan says fits (docs/user-guide/memory.md#auto-sizes).",
    )
    group.add_argument(
        "--global-batch-size", type=int, default=None, help="Samples per optimizer step over all ranks (§7)."
    )
    group.add_argument("--num-steps-per-rollout", type=int, default=1, help="Optimizer steps per rollout.")
    group.add_argument("--num-rollout", type=int, default=40, help="Rollouts (outer iterations) to run.")
    group.add_argument("--train-only", action="store_true", help="No rollout engine: train on dataset pairs (SFT).")
    ReadBy(group, WITH_POLICY_RATIO).add_argument(
        "--diffusion-recompute-old-log-prob",
        action="store_true",
        help="Recompute windows 1.. old log-probs with the trainer's forward before any update (algorithms with a "
        "log-prob ratio: policy_loss).",
    )


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rollout and data")
    group.add_argument(
        "--prompt-data",
        default="builtin:shapes",
        help="JSONL of prompts (and images for SFT; source images for an editing or image-to-video family), a .txt "
        "of prompts (one a line), builtin:shapes, builtin:shapes-edit, builtin:moving-shapes or builtin:ocr.",
    )
    group.add_argument("--input-key", default="prompt", help="JSONL key of the prompt.")
    group.add_argument(
        "--image-key",
        default=None,
        help="JSONL key of sft_loss's target image path, relative to the file (default: image; target for an "
        "editing or image-to-video family, whose 'image' / 'images' name the source images).",
    )
    group.add_argument("--metadata-key", default="metadata", help="JSONL key of per-prompt metadata.")
    # not a flag: the family's source images per prompt, (fewest, most), set by the start-up checks from the family
    # (`TrainPipelineConfig.source_image_range`); what the data loaders and the eval read
    parser.set_defaults(source_image_range=(0, 0))
    group.add_argument(
        "--builtin-dataset-size",
        type=int,
        default=2048,
        help="Items of builtin:shapes (and the other built-in worlds).",
    )
    group.add_argument("--rollout-batch-size", type=int, default=8, help="Prompts per rollout.")
    group.add_argument(
        "--n-samples-per-prompt",
        type=int,
        default=8,
        help="Samples per prompt (a GRPO group: at least 2 where the loss trains on group advantages).",
    )
    group.add_argument("--rollout-seed", type=int, default=42, help="Seeds data order and per-sample noise.")
    group.add_argument("--no-rollout-shuffle", action="store_true", help="Keep the file order every epoch.")
    group.add_argument(
        "--allow-repeated-prompts",
        action="store_true",
        help="Accept prompt data with fewer distinct prompts than --rollout-batch-size (rollouts then repeat them).",
    )
    group.add_argument("--diffusion-num-steps", type=int, default=10, help="Sampling steps.")
    group.add_argument(
        "--diffusion-guidance-scale",
        type=float,
        default=None,
        help=f"CFG scale of sampling; ≤ 1 disables CFG (default: the algorithm's, 4.5 unless it samples CFG-free: "
        f"{CFG_FREE}).",
    )
    group.add_argument(
        "--diffusion-guidance-scale-2",
        type=float,
        default=None,
        help="Two-expert families (Wan 2.2): CFG scale of the low-noise expert's steps (default: "
        "--diffusion-guidance-scale, as in WanPipeline).",
    )
    group.add_argument("--negative-prompt", default="", help="Negative prompt of the CFG branch.")


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument("--output-dir", default="outputs/run", help="metrics.jsonl, train.log and images go here.")
    group.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    group.add_argument("--no-progress", action="store_true", help="No tqdm progress bar.")
    group.add_argument(
        "--use-tensorboard",
        action="store_true",
        help="Also log to OUTPUT_DIR/tensorboard (pip install 'miles[tensorboard]').",
    )
    group.add_argument("--use-wandb", action="store_true", help="Also log to wandb (pip install 'miles[wandb]').")
    wandb = ReadBy(group, ByFlag("use_wandb"))
    wandb.add_argument("--wandb-project", default="miles", help="wandb project.")
    wandb.add_argument("--wandb-group", default=None, help="wandb group (e.g. one per sweep).")
    wandb.add_argument("--wandb-run-name", default=None, help="wandb run name (default: wandb's).")


SHARED_GROUPS = (
    add_cluster_arguments,
    add_model_arguments,
    add_train_arguments,
    add_fsdp_arguments,
    add_rollout_arguments,
    add_weight_sync_arguments,
    *RL_ARGUMENT_GROUPS,
    add_eval_arguments,
    add_checkpoint_arguments,
    add_logging_arguments,
    add_plan_arguments,
)


def add_algorithm_arguments(parser: argparse.ArgumentParser, algorithms: Iterable[Algorithm]) -> None:
    """Each algorithm's own flags, then the `--<role>-*` overrides of their roles other than the actor."""
    algorithms = list(algorithms)
    for algorithm in algorithms:
        known = len(parser._actions)
        try:
            algorithm.add_arguments(parser)
        except argparse.ArgumentError as exc:
            raise ValueError(f"the flags of algorithm {algorithm.name!r}: {exc}") from exc
        mark_owned(parser._actions[known:], algorithm)  # read by it, and by the algorithms that say they read them
    add_role_arguments(parser, algorithms)


def build_parser(algorithms: Iterable[Algorithm] | None = None) -> argparse.ArgumentParser:
    """The shared flags and those of `algorithms` (default: every registered one, plugins included)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="miles: post-train diffusion / flow-matching models (SFT, Flow-GRPO, NFT, DMD2, custom)."
    )
    parser.add_argument("--config", default=None, help="YAML of flag defaults (command line wins).")
    parser.set_defaults(default_notes=())  # not a flag: the defaults derive_args chose, in words (logged at start)
    for add_group in SHARED_GROUPS:
        add_group(parser)
    add_algorithm_arguments(parser, ALGORITHMS.values() if algorithms is None else algorithms)
    return parser


def default_args(**overrides: Any) -> argparse.Namespace:
    """Every flag at its declared default, neither validated nor derived, then `overrides` (by dest): the full set of
    flags a reader of the parsed flags may rely on, for a tool or a test that calls one without a command line."""
    args = build_parser().parse_args([])
    unknown = sorted(set(overrides) - set(vars(args)))
    if unknown:
        raise TypeError(f"default_args: no flag has the dest {', '.join(unknown)}")
    return argparse.Namespace(**{**vars(args), **overrides})


def read_first_pass(argv: Sequence[str] | None) -> tuple[str | None, dict[str, Any]]:
    """The first pass, before the parser exists: --config's mapping read, and the --algorithm-path module (from the
    command line or the config) imported, so that its algorithms' flags and roles are in the parser."""
    first = argparse.ArgumentParser(prog=PROG, add_help=False)
    first.add_argument("--config", default=None)
    first.add_argument("--algorithm-path", default=None)
    known, _ = first.parse_known_args(argv)
    try:
        config = read_config(known.config) if known.config else {}
    except ArgumentError as exc:
        first.error(str(exc))
    plugin = known.algorithm_path or next((v for k, v in config.items() if dest_of(k) == "algorithm_path"), None)
    if plugin:
        try:
            load_module(str(plugin))  # it registers its algorithms and hub entries
        except HookLoadError as exc:
            first.error(f"--algorithm-path: {exc}")
    return known.config, config


def parse_args(argv: Sequence[str] | None = None, *, validate: bool = True) -> argparse.Namespace:
    """The run's flags: the first pass, the parser with every registered algorithm, the config as defaults, then
    (with `validate`) every rule, the flags the user set that the run would not read (flag_readers.py), and the
    computed defaults."""
    config_path, config = read_first_pass(argv)
    try:
        parser = build_parser()
    except ValueError as exc:  # a plugin's flag or role clashes with a registered one
        argparse.ArgumentParser(prog=PROG).error(str(exc))
    if config:
        assert config_path is not None  # a config is read from --config
        try:
            parser.set_defaults(**config_defaults(parser, config, config_path, flag_ranges()))
        except ArgumentError as exc:
            parser.error(str(exc))
    args = parser.parse_args(argv)
    if validate:
        try:
            validate_args(args)
        except ArgumentError as exc:
            parser.error(str(exc))
        unread = unread_flags(parser, given_dests(parser, argv, config), args)  # set by the user, read by nothing
        if unread:
            parser.error("; ".join(unread))
        derive_args(args)
    return args
