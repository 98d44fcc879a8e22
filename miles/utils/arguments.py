"""Command-line arguments: argparse groups, `--config file.yaml` as defaults, and one `validate_args`."""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Sequence
from typing import Any

import yaml

from miles.models.options import add_family_arguments
from miles.utils.eval_arguments import add_eval_arguments, validate_eval_args
from miles.utils.fsdp_arguments import add_fsdp_arguments, validate_fsdp_args
from miles.utils.misc import HookLoadError, load_module
from miles.utils.ranges import range_violation
from miles.utils.rl_arguments import RL_ARGUMENT_GROUPS, validate_rl_args

LOSS_TYPES = ("sft_loss", "policy_loss", "nft", "dmd2", "custom_loss")
TRAIN_HOOK_FLAGS = (
    "custom_prepare_train_batch_path",
    "custom_loss_function_path",
    "custom_train_input_postprocess_path",
    "custom_train_output_path",
)
CRITIC_FLAGS = (
    "critic_checkpoint",
    "critic_lr",
    "critic_load",
    "critic_save",
    "critic_num_steps_per_rollout",
    "critic_micro_batch_size",
)
RECOMPUTE_REJECTED = ("sft_loss", "nft", "dmd2")


class ArgumentError(ValueError):
    """A flag combination that cannot run; the message names the flags."""


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--ray-address", default=None, help="Ray cluster address; default starts a local one.")
    group.add_argument("--dp-size", type=int, default=2, help="Data-parallel ranks (Ray actors) per trained role.")
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
        help="Model family (auto: from model_index.json's _class_name); built in: sd3 (StableDiffusion3Pipeline), "
        "flux (FluxPipeline), ltx2 (LTX2Pipeline), qwen-image (QwenImagePipeline), wan (WanPipeline).",
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
        default="nft",
        help=f"The algorithm (ARCHITECTURE §1): {', '.join(LOSS_TYPES)}, or one an --algorithm-path registers.",
    )
    group.add_argument(
        "--algorithm-path",
        default=None,
        help="A module or file.py imported in every process first; it registers new loss types in the loss hub "
        "and the rollout hub (docs/user-guide/customization.md).",
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
    group.add_argument("--micro-batch-size", type=int, default=32, help="Train pairs per forward/backward.")
    group.add_argument(
        "--global-batch-size", type=int, default=None, help="Samples per optimizer step over all ranks (§7)."
    )
    group.add_argument("--num-steps-per-rollout", type=int, default=1, help="Optimizer steps per rollout.")
    group.add_argument("--num-rollout", type=int, default=40, help="Rollouts (outer iterations) to run.")
    group.add_argument("--train-only", action="store_true", help="No rollout engine: train on dataset pairs (SFT).")
    group.add_argument(
        "--diffusion-recompute-old-log-prob",
        action="store_true",
        help="Recompute windows 1.. old log-probs with the trainer's forward before any update (policy_loss).",
    )
    group.add_argument(
        "--sft-timestep-sampling",
        choices=("logit_normal", "uniform", "mode"),
        default="logit_normal",
        help="Density of u for σ lookup.",
    )
    group.add_argument("--sft-logit-mean", type=float, default=0.0)
    group.add_argument("--sft-logit-std", type=float, default=1.0)
    group.add_argument("--sft-mode-scale", type=float, default=1.29)
    group.add_argument(
        "--sft-loss-weighting", choices=("none", "sigma_sqrt", "cosmap"), default="none", help="w(σ) of the loss."
    )


def add_custom_hook_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("custom hooks (pkg.mod.fn or path/file.py:fn)")
    group.add_argument("--custom-prepare-train-batch-path", default=None, help="custom_loss: the prepare hook.")
    group.add_argument("--custom-loss-function-path", default=None, help="custom_loss: the formula hook.")
    group.add_argument(
        "--custom-train-input-postprocess-path", default=None, help="custom_loss: post-process the train pairs."
    )
    group.add_argument("--custom-train-output-path", default=None, help="custom_loss: what `train` returns.")


def add_critic_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("critic overrides (dmd2 only; everything else is shared with the actor)")
    group.add_argument("--critic-checkpoint", default=None, help="Critic init (default: the teacher).")
    group.add_argument("--critic-lr", type=float, default=None, help="Critic learning rate (default: --lr).")
    group.add_argument("--critic-load", default=None, help="Critic checkpoint dir to resume (default: --load).")
    group.add_argument("--critic-save", default=None, help="Critic checkpoint dir (default: --save).")
    group.add_argument("--critic-num-steps-per-rollout", type=int, default=None)
    group.add_argument("--critic-micro-batch-size", type=int, default=None)


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rollout and data")
    group.add_argument(
        "--prompt-data", default="builtin:shapes", help="JSONL of prompts (and images for SFT), or builtin:shapes."
    )
    group.add_argument("--input-key", default="prompt", help="JSONL key of the prompt.")
    group.add_argument("--image-key", default="image", help="JSONL key of the image path (SFT), relative to the file.")
    group.add_argument("--metadata-key", default="metadata", help="JSONL key of per-prompt metadata.")
    group.add_argument("--builtin-dataset-size", type=int, default=2048, help="Items of builtin:shapes.")
    group.add_argument("--rollout-batch-size", type=int, default=8, help="Prompts per rollout.")
    group.add_argument("--n-samples-per-prompt", type=int, default=8, help="Samples per prompt (a GRPO group).")
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
        help="CFG scale of sampling; ≤ 1 disables CFG (default 4.5; nft: 1, CFG-free like DiffusionNFT; "
        "dmd2: 1, its generator is CFG-free and a scale > 1 is an error).",
    )
    group.add_argument(
        "--diffusion-guidance-scale-2",
        type=float,
        default=None,
        help="Two-expert families (Wan 2.2): CFG scale of the low-noise expert's steps (default: "
        "--diffusion-guidance-scale, as in WanPipeline).",
    )
    group.add_argument("--negative-prompt", default="", help="Negative prompt of the CFG branch.")


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("checkpoints")
    group.add_argument("--save", default=None, help="Checkpoint dir: DIR/iter_XXXXXXX/{role}/.")
    group.add_argument("--save-interval", type=int, default=None, help="Save every N rollouts (and at the end).")
    group.add_argument("--load", default=None, help="Resume from the latest checkpoint in DIR.")
    group.add_argument("--no-load-optim", action="store_true", help="With --load: weights only, fresh optimizer.")
    group.add_argument(
        "--skip-checkpoint-checksums",
        action="store_true",
        help="At load, check file sizes against the checkpoint's manifest but not CRC32s (very large checkpoints "
        "on trusted storage; flipped bytes then go unnoticed).",
    )
    group.add_argument("--save-hf", default=None, help="At the end, write a diffusers pipeline folder with the result.")


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
    group.add_argument("--wandb-project", default="miles", help="wandb project.")
    group.add_argument("--wandb-group", default=None, help="wandb group (e.g. one per sweep).")
    group.add_argument("--wandb-run-name", default=None, help="wandb run name (default: wandb's).")


ARGUMENT_GROUPS = (
    add_cluster_arguments,
    add_model_arguments,
    add_train_arguments,
    add_fsdp_arguments,
    add_custom_hook_arguments,
    add_critic_arguments,
    add_rollout_arguments,
    *RL_ARGUMENT_GROUPS,
    add_eval_arguments,
    add_checkpoint_arguments,
    add_logging_arguments,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_diffusion.py",
        description="miles: post-train diffusion / flow-matching models (SFT, Flow-GRPO, NFT, DMD2, custom).",
    )
    parser.add_argument("--config", default=None, help="YAML of flag defaults (command line wins).")
    for add_group in ARGUMENT_GROUPS:
        add_group(parser)
    return parser


def load_config_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Read a YAML mapping of flag -> value; keys may use dashes or underscores; unknown keys are errors."""
    if not os.path.isfile(path):
        raise ArgumentError(f"--config {path}: file not found")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ArgumentError(f"--config {path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flag names to values")
    known = {action.dest: action for action in parser._actions if action.dest not in ("help", "config")}
    defaults = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in known:
            close = difflib.get_close_matches(dest, known, n=1)
            hint = f"; did you mean {flag(close[0])}?" if close else ""
            raise ArgumentError(f"--config {path}: unknown key {key!r}{hint}")
        defaults[dest] = _config_value(known[dest], value, f"--config {path}: key {key!r}")
    return defaults


def _config_value(action: argparse.Action, value: Any, where: str) -> Any:
    """A YAML value through what the command line applies: the flag's type, its choices and its numeric range."""
    if value is None:
        return None
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ArgumentError(f"{where} ({flag(action.dest)}) takes true or false, got {value!r}")
        return value
    if isinstance(value, (bool, list, dict)):
        raise ArgumentError(f"{where} ({flag(action.dest)}) takes one value, got {value!r}")
    converted = str(value)
    if action.type is not None:
        try:
            converted = action.type(converted)
        except (TypeError, ValueError):
            name = getattr(action.type, "__name__", "value")
            raise ArgumentError(f"{where} ({flag(action.dest)}): invalid {name} value {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise ArgumentError(f"{where} ({flag(action.dest)}): {value!r} is not one of {list(action.choices)}")
    problem = range_violation(action.dest, converted)
    if problem is not None:
        raise ArgumentError(f"{where}: {problem}")
    return converted


def parse_args(argv: Sequence[str] | None = None, *, validate: bool = True) -> argparse.Namespace:
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.config:
        try:
            parser.set_defaults(**load_config_defaults(parser, first.config))
        except ArgumentError as exc:
            parser.error(str(exc))
    args = parser.parse_args(argv)
    if validate:
        try:
            validate_args(args)
        except ArgumentError as exc:
            parser.error(str(exc))
    return args


def validate_args(args: argparse.Namespace) -> None:
    """Every cross-flag rule of ARCHITECTURE §8, checked before any actor starts; fills derived defaults."""
    loss = args.loss_type
    for dest, value in sorted(vars(args).items()):  # numeric ranges first: later rules assume them
        problem = range_violation(dest, value)
        if problem is not None:
            raise ArgumentError(problem)
    if args.algorithm_path:
        try:
            load_module(args.algorithm_path)  # its registrations are checked before any actor starts
        except HookLoadError as exc:
            raise ArgumentError(f"--algorithm-path: {exc}") from exc
    elif loss not in LOSS_TYPES:
        raise ArgumentError(
            f"--loss-type {loss!r} is unknown: choose one of {', '.join(LOSS_TYPES)}, or register it with "
            "--algorithm-path"
        )
    if args.train_pipeline_config_path:
        if args.model_family != "auto":
            raise ArgumentError("give --model-family or --train-pipeline-config-path, not both")
        args.model_family = args.train_pipeline_config_path  # every process resolves the family from it
    if args.diffusion_recompute_old_log_prob and loss in RECOMPUTE_REJECTED:
        raise ArgumentError(
            f"--diffusion-recompute-old-log-prob is not supported with --loss-type {loss} (it has no log-prob ratio)"
        )
    if loss == "dmd2" and not args.teacher_load:
        raise ArgumentError("--loss-type dmd2 requires --teacher-load (the frozen teacher the critic scores against)")
    given_hooks = [flag(d) for d in TRAIN_HOOK_FLAGS if getattr(args, d)]
    if given_hooks and loss != "custom_loss":
        raise ArgumentError(
            f"{', '.join(given_hooks)} only apply to --loss-type custom_loss (under {loss} the loss hub picks the hooks)"
        )
    if loss == "custom_loss":
        for dest in ("custom_prepare_train_batch_path", "custom_loss_function_path"):
            if not getattr(args, dest):
                raise ArgumentError(f"--loss-type custom_loss requires {flag(dest)}")
    given_critic = [flag(d) for d in CRITIC_FLAGS if getattr(args, d) is not None]
    if given_critic and loss != "dmd2":
        raise ArgumentError(f"{', '.join(given_critic)} only apply to --loss-type dmd2 (the only loss with a critic)")
    if loss == "sft_loss":  # SFT trains each dataset pair once: there are no sample groups
        args.n_samples_per_prompt = 1
    if args.diffusion_guidance_scale is None:  # DiffusionNFT and the DMD2 generator sample CFG-free
        args.diffusion_guidance_scale = 1.0 if loss in ("nft", "dmd2") else 4.5
    if not args.hf_checkpoint:
        raise ArgumentError("--hf-checkpoint DIR is required (a local diffusers pipeline folder)")
    if loss == "sft_loss" and not args.train_only:
        raise ArgumentError("--loss-type sft_loss trains on dataset pairs: pass --train-only")
    if not args.prompt_data:
        raise ArgumentError("--prompt-data is required (a JSONL file or builtin:shapes)")
    if args.global_batch_size is None:
        total = args.rollout_batch_size * args.n_samples_per_prompt
        if total % args.num_steps_per_rollout != 0:
            raise ArgumentError(
                f"--rollout-batch-size {args.rollout_batch_size} x --n-samples-per-prompt {args.n_samples_per_prompt}"
                f" is not divisible by --num-steps-per-rollout {args.num_steps_per_rollout}"
            )
        args.global_batch_size = total // args.num_steps_per_rollout
    _validate_batch_invariant(args)
    if args.save_interval is not None and not (args.save or args.critic_save):
        raise ArgumentError("--save-interval needs --save DIR (or, under dmd2, --critic-save DIR)")
    if args.load and not os.path.isdir(args.load) and args.load != args.save:
        raise ArgumentError(f"--load {args.load}: directory not found (pass --load equal to --save to auto-resume)")
    validate_rl_args(args, _raise)
    validate_eval_args(args, _raise)
    validate_fsdp_args(args, _raise)
    if args.colocate and args.train_only:
        raise ArgumentError(
            "--colocate shares the GPUs between trainer ranks and rollout engines; --train-only has no engines"
        )
    if args.colocate_sleep == "on":
        alone = [f for f in ("async_rollout", "train_only", "debug_rollout_only") if getattr(args, f, False)]
        if alone:
            raise ArgumentError(
                f"--colocate-sleep on has the engines and the trainer ranks take turns on the GPU; {flag(alone[0])} "
                + ("runs both at once" if alone[0] == "async_rollout" else "leaves one of them out")
                + ": drop one of the two"
            )
    if loss == "dmd2":
        args.critic_lr = args.lr if args.critic_lr is None else args.critic_lr
        args.critic_num_steps_per_rollout = args.critic_num_steps_per_rollout or args.num_steps_per_rollout
        args.critic_micro_batch_size = args.critic_micro_batch_size or args.micro_batch_size
        separate = args.critic_save is not None and args.critic_save != args.save
        args.critic_save = args.critic_save or args.save
        if args.critic_load is None:  # a critic with its own save folder resumes from it (docs/user-guide/failures.md)
            args.critic_load = args.critic_save if separate and args.load else args.load
        if args.critic_load and not os.path.isdir(args.critic_load) and args.critic_load != args.critic_save:
            raise ArgumentError(f"--critic-load {args.critic_load}: directory not found")
        args.critic_checkpoint = args.critic_checkpoint or args.teacher_load


def _raise(message: str) -> None:
    raise ArgumentError(message)


def _validate_batch_invariant(args: argparse.Namespace) -> None:
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if samples != args.global_batch_size * args.num_steps_per_rollout:
        raise ArgumentError(
            f"batch invariant broken: --rollout-batch-size {args.rollout_batch_size} x --n-samples-per-prompt "
            f"{args.n_samples_per_prompt} = {samples} must equal --global-batch-size {args.global_batch_size} x "
            f"--num-steps-per-rollout {args.num_steps_per_rollout} = "
            f"{args.global_batch_size * args.num_steps_per_rollout}"
        )
    if args.global_batch_size % args.dp_size != 0:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} must be divisible by --dp-size {args.dp_size}"
        )
