"""Shared flags of the RL side: sampling and step strategy, the KL reference, LoRA and EMA (rewards and advantages:
`miles.arguments.rewards`); and their rules (each algorithm's own flags and rules are in its declaration,
miles/algorithms/)."""

from __future__ import annotations

import argparse

from miles.algorithms import BUILTIN_ALGORITHMS, Algorithm
from miles.arguments.config_file import flag
from miles.arguments.engine import add_engine_arguments
from miles.arguments.flag_readers import WITH_SDE_SAMPLES, ByAlgorithm, ByFlag, ReadBy
from miles.arguments.guard import add_guard_arguments
from miles.arguments.hook_paths import add_rollout_step_arguments, rollout_step_rules
from miles.arguments.rewards import add_reward_arguments, reward_rules

DEFAULT_NUM_SDE_STEPS = 3
MIXGRPO_DEFAULTS = {"mixgrpo_mode": "progressive", "mixgrpo_shift_interval": None, "mixgrpo_stride": 1}
MIXGRPO_FLASH_DEFAULTS = {"mixgrpo_flash": False, "mixgrpo_flash_ratio": 0.4}


def async_rollout_loss_types() -> str:
    """--async-rollout's help: the built-in loss types whose declarations accept it (`Algorithm.async_rollout`)."""
    accepted = [a for a in BUILTIN_ALGORITHMS if a.async_rollout]
    with_ratio = [a.name for a in accepted if a.log_prob_ratio]
    names = ", ".join(a.name for a in accepted)
    ratio_rule = f" ({', '.join(with_ratio)}: not with --diffusion-recompute-old-log-prob)" if with_ratio else ""
    return f"Accepted by {names}{ratio_rule} and a plugin whose declaration says async_rollout=True"


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (rollout engine)")
    group.add_argument("--rollout-num-engines", type=int, default=1, help="Rollout engine actors.")
    group.add_argument("--rollout-cpus-per-engine", type=float, default=0.5, help="CPU share of an engine on CPU.")
    group.add_argument("--rollout-gpus-per-engine", type=float, default=1.0, help="GPUs per engine on CUDA.")
    add_engine_arguments(group)
    group.add_argument(
        "--prompt-cache",
        default="auto",
        metavar="{auto,off,DIR}",
        help="Where the engines keep each prompt's text-encoder outputs (safetensors keyed by a digest of the encoders, "
        "tokenizer, dtype, device and prompt): the prompt set is encoded once, shared by the engines, which then free "
        "their text encoders; a later run with the same folder loads none. auto: OUTPUT_DIR/prompt_cache for the "
        "families where cached encodings are bit-identical to batch ones (not sd3, qwen-image*, wan-i2v); "
        "DIR: that folder, any family; off: encode every batch (docs/user-guide/performance.md).",
    )
    group.add_argument(
        "--async-rollout",
        action="store_true",
        help="Generate rollout k+1 while rollout k trains, with the weights before update k: staleness at most one "
        f"update, recorded as rollout/staleness. {async_rollout_loss_types()} (docs/user-guide/performance.md).",
    )
    sde = ReadBy(group, WITH_SDE_SAMPLES)
    sde.add_argument(
        "--diffusion-sde-type",
        choices=("sde", "cps", "dance", "ode"),
        default="sde",
        help="Step kernel (dance: DanceGRPO's, Flow-GRPO's mean with a constant std_t = the noise level).",
    )
    sde.add_argument("--diffusion-noise-level", type=float, default=0.7, help="SDE noise level a.")
    group.add_argument(
        "--diffusion-shared-initial-noise",
        action="store_true",
        help="A prompt's samples start from one latent; they differ by their SDE noise only (policy_loss).",
    )
    sde.add_argument(
        "--diffusion-num-sde-steps",
        type=int,
        default=DEFAULT_NUM_SDE_STEPS,
        help="Trained steps: one contiguous window of K (0: all but the last); ignored with a strategy path.",
    )
    sde.add_argument(
        "--diffusion-sde-window-range", default=None, help="a,b: the window starts in [a, b-K] (default 0,N-1)."
    )
    group.add_argument(
        "--diffusion-step-strategy-path", default=None, help="fn(args, rollout_id, num_steps) -> trained steps."
    )
    add_mixgrpo_arguments(group)
    add_rollout_debug_arguments(group)


def add_rollout_debug_arguments(group: argparse._ArgumentGroup) -> None:
    """What a rollout leaves to look at: debug runs, saved and replayed rollouts, image grids and video media."""
    group.add_argument("--debug-rollout-only", action="store_true", help="Generate and score; never train.")
    group.add_argument("--save-debug-rollout-data", default=None, help="Save each rollout's train data: DIR.")
    group.add_argument(
        "--load-debug-rollout-data", default=None, help="Replay rollouts saved by --save-debug-rollout-data: DIR."
    )
    group.add_argument(
        "--image-grid-interval",
        type=int,
        default=1,
        help="Save an image grid (video: mp4s and a contact sheet) every N rollouts.",
    )
    group.add_argument(
        "--media-max-samples",
        type=int,
        default=4,
        help="Video: samples of a rollout or eval saved as media/NAME/sample_K.mp4 (and contact sheet rows).",
    )


def add_mixgrpo_arguments(group: argparse._ArgumentGroup) -> None:
    """MixGRPO's sliding SDE window (arXiv 2507.21802), a step strategy for every SDE-sampling loss type."""
    group.add_argument(
        "--mixgrpo-window-size",
        type=int,
        default=None,
        help="MixGRPO: train a sliding window of W SDE steps, the others ODE (FLUX recipe: 4). Replaces "
        "--diffusion-num-sde-steps.",
    )
    group.add_argument(
        "--mixgrpo-mode",
        choices=("progressive", "random"),
        default=MIXGRPO_DEFAULTS["mixgrpo_mode"],
        help="progressive: the window moves by the stride every τ rollouts and rolls back to 0; random: its start "
        "is drawn per rollout from (--rollout-seed, rollout id).",
    )
    group.add_argument(
        "--mixgrpo-shift-interval",
        type=int,
        default=MIXGRPO_DEFAULTS["mixgrpo_shift_interval"],
        help="τ: rollouts per window position (default 25, 20 with --mixgrpo-flash).",
    )
    group.add_argument(
        "--mixgrpo-stride",
        type=int,
        default=MIXGRPO_DEFAULTS["mixgrpo_stride"],
        help="Steps the progressive window moves per shift (0: it stays at step 0, the authors' Flash*).",
    )
    group.add_argument(
        "--mixgrpo-flash",
        action="store_true",
        help="MixGRPO-Flash: after the window, DPM-Solver++(2M) on a compressed grid (rollout only; fewer forwards).",
    )
    group.add_argument(
        "--mixgrpo-flash-ratio",
        type=float,
        default=MIXGRPO_FLASH_DEFAULTS["mixgrpo_flash_ratio"],
        help="Flash: the N - L steps after the window's last step L become max(int((N - L)·ratio), 2) grid points.",
    )


def mixgrpo_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """The MixGRPO flags need the window; the window replaces the other step strategies and needs SDE sampling."""
    window = args.mixgrpo_window_size
    if not window:
        given = [k for k, v in {**MIXGRPO_DEFAULTS, **MIXGRPO_FLASH_DEFAULTS}.items() if getattr(args, k) != v]
        verb = "needs" if len(given) == 1 else "need"
        return [f"{', '.join(flag(k) for k in given)} {verb} --mixgrpo-window-size (MixGRPO's window)"] if given else []
    errors = []
    if not algorithm.samples_sde:
        errors.append(
            f"--mixgrpo-window-size chooses SDE steps; --loss-type {algorithm.name} samples no SDE trajectories"
        )
    if args.diffusion_sde_type == "ode":
        errors.append("--mixgrpo-window-size needs SDE steps; --diffusion-sde-type ode has none")
    others = {
        "diffusion_step_strategy_path": args.diffusion_step_strategy_path,
        "diffusion_sde_window_range": args.diffusion_sde_window_range,
        "diffusion_num_sde_steps": args.diffusion_num_sde_steps != DEFAULT_NUM_SDE_STEPS,
    }
    for dest, given in others.items():
        if given:
            errors.append(f"--mixgrpo-window-size and {flag(dest)} both choose the trained steps: give one of them")
    if window > args.diffusion_num_steps - 2:
        errors.append(
            f"--mixgrpo-window-size {window} must be <= --diffusion-num-steps {args.diffusion_num_steps} - 2 (the "
            "window never holds the last two steps)"
        )
    if args.mixgrpo_mode == "random":
        ignored = [
            flag(k) for k in ("mixgrpo_shift_interval", "mixgrpo_stride") if getattr(args, k) != MIXGRPO_DEFAULTS[k]
        ]
        if ignored:
            errors.append(f"{', '.join(ignored)} move the progressive window; --mixgrpo-mode random draws it")
    if args.mixgrpo_flash_ratio != MIXGRPO_FLASH_DEFAULTS["mixgrpo_flash_ratio"] and not args.mixgrpo_flash:
        errors.append("--mixgrpo-flash-ratio needs --mixgrpo-flash")
    return errors


def add_reference_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KL reference (read by every algorithm with a KL term)")
    with_kl = ByAlgorithm(lambda a: False, "with a KL term")  # they list it in their declaration's `reads`
    ReadBy(group, with_kl).add_argument(
        "--ref-mode", choices=("none", "lora_base", "ema"), default="none", help="The KL reference."
    )


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA")
    group.add_argument("--use-lora", action="store_true", help="Train LoRA adapters instead of full weights.")
    lora = ReadBy(group, ByFlag("use_lora"))
    lora.add_argument("--lora-rank", type=int, default=8)
    lora.add_argument("--lora-alpha", type=float, default=None, help="Default: the rank.")
    lora.add_argument("--lora-target-modules", default=None, help="Comma list; default per model family.")
    lora.add_argument(
        "--lora-init-weights",
        choices=("true", "false", "gaussian"),
        default="true",
        help="peft init: true (B = 0, starts at the base model), gaussian, false (random A and B).",
    )


def add_ema_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("EMA")
    group.add_argument("--use-ema", action="store_true", help="Keep an EMA of the trained weights.")
    ema = ReadBy(group, ByFlag("use_ema"))
    ema.add_argument("--ema-decay", type=float, default=0.995)
    ema.add_argument(
        "--ema-warmup", choices=("none", "power"), default="power", help="power: decay min(d, (1+s)/(10+s))."
    )
    ema.add_argument("--ema-update-interval", type=int, default=1, help="Update every N optimizer steps.")
    group.add_argument(
        "--ema-rollout-policy", choices=("live", "ema"), default="live", help="Which weights the engines sample."
    )


def add_monitor_arguments(parser: argparse.ArgumentParser) -> None:
    """The reward-hacking monitors' warning thresholds (miles/rollout/monitors.py; docs/user-guide/rewards.md)."""
    group = parser.add_argument_group("reward-hacking monitors (monitor/* metrics) and what a trip does")
    group.add_argument(
        "--monitor-image-drift",
        type=float,
        default=0.1,
        help="Warn when the batch-mean brightness or saturation of the decoded samples (each in [0, 1]) moves more "
        "than this from the first rollout's (0: no warning).",
    )
    group.add_argument(
        "--monitor-norm-drift",
        type=float,
        default=0.25,
        help="Warn when the batch-mean RMS norm of the final latent x0 moves more than this fraction of the first "
        "rollout's (0: no warning).",
    )
    group.add_argument(
        "--monitor-diversity-collapse",
        type=float,
        default=0.5,
        help="Warn when the diversity within prompt groups (pixel, or CLIP with a CLIP reward) falls below this "
        "fraction of the first rollout's (0: no warning).",
    )
    add_guard_arguments(group)


RL_ARGUMENT_GROUPS = (
    add_sampling_arguments,
    add_reward_arguments,
    add_monitor_arguments,
    add_reference_arguments,
    add_lora_arguments,
    add_ema_arguments,
    add_rollout_step_arguments,
)


def rl_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """The shared rules of the RL flags (an algorithm's own are in its declaration)."""
    errors = []
    if args.ref_mode == "lora_base" and not args.use_lora:
        errors.append("--ref-mode lora_base needs --use-lora (the reference is the LoRA base)")
    if args.ref_mode == "ema" and not args.use_ema:
        errors.append("--ref-mode ema needs --use-ema")
    if args.ema_rollout_policy == "ema" and not args.use_ema:
        errors.append("--ema-rollout-policy ema needs --use-ema")
    if args.diffusion_shared_initial_noise and not algorithm.samples_sde:
        errors.append(
            f"--diffusion-shared-initial-noise is for SDE rollouts; --loss-type {algorithm.name} samples no SDE "
            "trajectories"
        )
    errors += mixgrpo_rules(args, algorithm) + rollout_step_rules(args, algorithm)
    if args.save_debug_rollout_data and args.load_debug_rollout_data:
        errors.append("--save-debug-rollout-data and --load-debug-rollout-data exclude each other")
    return errors + reward_rules(args, algorithm)
