"""The cross-flag rules of a parsed command line and its computed defaults (ARCHITECTURE §8).

`validate_args` never mutates args: it checks the ranges, then the rules on the values given, then the rules that
involve computed defaults on a derived copy. `derive_args` is the one step that fills the computed defaults, in a
fixed order; `parse_args` calls it once every rule passed."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterable
from typing import Any

from miles.algorithms import ALGORITHMS, ROLE_OVERRIDES, Algorithm, algorithm_of, get_algorithm, role_dest, role_flag
from miles.algorithms.roles import extra_roles, folder_rules, override_rules, role_defaults
from miles.arguments.checkpoints import restart_rules
from miles.arguments.config_file import ArgumentError, flag
from miles.arguments.evaluation import eval_defaults, eval_rules
from miles.arguments.fsdp import local_device_defaults, precision_rules, sharding_rules
from miles.arguments.guard import monitor_rules
from miles.arguments.plan import auto_size_defaults
from miles.arguments.rl import rl_rules
from miles.models.options import family_option_ranges
from miles.utils.ranges import FLAG_RANGES, Range, range_violation
from miles.weight_sync.arguments import weight_sync_rules

__all__ = ["ArgumentError", "derive_args", "flag_ranges", "validate_args"]


def flag_ranges(algorithms: Iterable[Algorithm] | None = None) -> dict[str, Range]:
    """Every numeric flag's range: the shared flags', each family option's, each algorithm's own, and each role
    override's (the actor flag's: --critic-lr has --lr's)."""
    algorithms = list(ALGORITHMS.values() if algorithms is None else algorithms)
    ranges = {**FLAG_RANGES, **family_option_ranges()}
    for algorithm in algorithms:
        ranges.update(algorithm.flag_ranges)
    for name in extra_roles(algorithms):
        for override in ROLE_OVERRIDES:
            if role_dest("actor", override) in FLAG_RANGES:
                ranges[role_dest(name, override)] = FLAG_RANGES[role_dest("actor", override)]
    return ranges


def validate_args(args: argparse.Namespace) -> None:
    """Every rule, checked before any actor starts. Raises ArgumentError naming every broken rule of the first stage
    that has one: the ranges (later rules assume them), the given values, the values with computed defaults."""
    try:
        algorithm = get_algorithm(args.loss_type)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    args = argparse.Namespace(**{**vars(args), **implied_flags(args, algorithm)})  # a view: args stays as given
    for stage in (range_rules, given_rules, derived_rules):
        errors = stage(args, algorithm)
        if errors:
            raise ArgumentError("; ".join(errors))


def range_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    ranges = flag_ranges()
    return [p for dest, value in sorted(vars(args).items()) if (p := range_violation(dest, value, ranges))]


def given_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """The rules on the flags as given (shared ones; an algorithm's own see its computed defaults too)."""
    errors = []
    if args.train_pipeline_config_path and args.model_family != "auto":
        errors.append("give --model-family or --train-pipeline-config-path, not both")
    if args.diffusion_recompute_old_log_prob and not algorithm.log_prob_ratio:
        errors.append(
            f"--diffusion-recompute-old-log-prob is not supported with --loss-type {algorithm.name} (it has no "
            "log-prob ratio)"
        )
    errors += exclusive_rules(args, algorithm) + override_rules(args, ALGORITHMS.values())
    if not args.hf_checkpoint:
        errors.append("--hf-checkpoint DIR is required (a local diffusers pipeline folder)")
    if args.train_only and not algorithm.accepts_train_only:
        errors.append(f"--train-only skips the rollout engine, which --loss-type {algorithm.name} needs")
    if not args.prompt_data:
        errors.append("--prompt-data is required (a JSONL or .txt file, builtin:shapes or builtin:ocr)")
    roles = algorithm.role_names[::-1]  # the actor's --save first
    if args.save_interval is not None and not any(getattr(args, role_dest(r, "save"), None) for r in roles):
        errors.append("--save-interval needs " + " or ".join(f"{role_flag(r, 'save')} DIR" for r in roles))
    errors += restart_rules(args) + weight_sync_rules(args)
    return errors + rl_rules(args, algorithm) + eval_rules(args) + sharding_rules(args) + colocate_rules(args)


def exclusive_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """Another algorithm's exclusive flags given: they would be silently ignored under this one."""
    errors = []
    for other in ALGORITHMS.values():
        given = [flag(d) for d in other.exclusive_flags if other is not algorithm and getattr(args, d, None)]
        if given:
            errors.append(
                f"{', '.join(given)} only apply to --loss-type {other.name} (under {algorithm.name} they would be "
                "ignored)"
            )
    return errors


def colocate_rules(args: argparse.Namespace) -> list[str]:
    errors = []
    if args.colocate and args.train_only:
        errors.append(
            "--colocate shares the GPUs between trainer ranks and rollout engines; --train-only has no engines"
        )
    alone = [f for f in ("async_rollout", "train_only", "debug_rollout_only") if getattr(args, f)]
    if args.colocate_sleep == "on" and alone:
        errors.append(
            f"--colocate-sleep on has the engines and the trainer ranks take turns on the GPU; {flag(alone[0])} "
            + ("runs both at once" if alone[0] == "async_rollout" else "leaves one of them out")
            + ": drop one of the two"
        )
    return errors


def derived_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """The rules that involve computed defaults, checked on a derived copy (args itself stays as given)."""
    view = derive_args(copy.copy(args))
    rules = [*batch_rules(args, view), *algorithm.validate(view), *folder_rules(view), *precision_rules(view)]
    return rules + monitor_rules(view, algorithm)


def batch_rules(args: argparse.Namespace, view: argparse.Namespace) -> list[str]:
    """The batch invariant (§7) on the run's values; `args` says whether --global-batch-size was given."""
    samples, steps = view.rollout_batch_size * view.n_samples_per_prompt, view.num_steps_per_rollout
    if args.global_batch_size is None and samples % steps != 0:
        return [
            f"--rollout-batch-size {view.rollout_batch_size} x --n-samples-per-prompt {view.n_samples_per_prompt}"
            f" is not divisible by --num-steps-per-rollout {steps}"
        ]
    errors = []
    if samples != view.global_batch_size * steps:
        errors.append(
            f"batch invariant broken: --rollout-batch-size {view.rollout_batch_size} x --n-samples-per-prompt "
            f"{view.n_samples_per_prompt} = {samples} must equal --global-batch-size {view.global_batch_size} x "
            f"--num-steps-per-rollout {steps} = {view.global_batch_size * steps}"
        )
    if view.global_batch_size % view.dp_size != 0:
        errors.append(f"--global-batch-size {view.global_batch_size} must be divisible by --dp-size {view.dp_size}")
    return errors


def implied_flags(args: argparse.Namespace, algorithm: Algorithm) -> dict[str, Any]:
    """What the algorithm implies of the shared flags: one that trains on dataset pairs only runs --train-only."""
    return {} if algorithm.uses_engines or args.train_only else {"train_only": True}


def default_notes(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """The defaults chosen for this run from the flags as given, in words (the driver logs them at start)."""
    notes = (
        [f"--loss-type {algorithm.name} trains on dataset pairs: --train-only"]
        if implied_flags(args, algorithm)
        else []
    )
    return notes + algorithm.default_notes(args)


def derive_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every computed default, in this order (each step reads the ones before): the notes that say them
    (`args.default_notes`), the flags the algorithm implies (`implied_flags`), the family from
    --train-pipeline-config-path, the algorithm's own (`derive`), the sampling guidance and the advantage's reward
    std (the algorithm's), the global batch size (from the batch invariant), the eval interval, the `auto` sizes (`auto_sizes`), the
    roles' overrides (`role_followers`: those not given), and the `auto` device and dtype of a cluster this run starts. Returns `args`, updated."""
    algorithm = algorithm_of(args)
    args.default_notes = tuple(default_notes(args, algorithm))
    vars(args).update(implied_flags(args, algorithm))
    if args.train_pipeline_config_path:
        args.model_family = args.train_pipeline_config_path  # every process resolves the family from it
    vars(args).update(algorithm.derive(args))
    if args.diffusion_guidance_scale is None:
        args.diffusion_guidance_scale = algorithm.guidance_scale
    if args.globalize_reward_std is None:
        args.globalize_reward_std = algorithm.globalize_reward_std
    if args.global_batch_size is None:
        args.global_batch_size = args.rollout_batch_size * args.n_samples_per_prompt // args.num_steps_per_rollout
    vars(args).update(eval_defaults(args, algorithm))
    vars(args).update(auto_size_defaults(args))  # before the roles' overrides, which copy the concrete values
    followers = role_defaults(args)
    vars(args).update(followers)
    args.role_followers = tuple(followers)  # the roles' overrides that follow the shared flag (not given)
    vars(args).update(local_device_defaults(args))
    return args
