"""The rollout-side extension points: each path flag names a `module.fn` or `file.py:fn`, what an algorithm must do
for it to be read, and the signature it must have. Everything given is loaded and signature-checked before any actor
starts."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.algorithms import Algorithm
from miles.arguments.flag_readers import ByFlag, ReadBy
from miles.utils.misc import HookLoadError, load_function

# what a path flag needs of the run's algorithm (an `Algorithm` capability) besides a generating rollout (every one
# of them does: not --train-only), and how an error says it
NEEDS = {
    "scores_rewards": "an algorithm that trains on rewards (filters and advantages)",
    "samples_sde": "an algorithm that samples SDE trajectories (the trained steps)",
}


@dataclass(frozen=True)
class PathFlag:
    """One path flag: its parameters (positional, in order), what it returns, and the capability it needs."""

    flag: str
    params: tuple[str, ...]
    returns: str
    needs: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def signature(self) -> str:
        return f"fn({', '.join(self.params)}) -> {self.returns}"


PATH_FLAGS: tuple[PathFlag, ...] = (
    PathFlag("--rollout-function-path", ("args", "rollout_id", "manager"), "TrainPairs"),
    PathFlag("--data-source-path", ("args", "rollout_id", "num_prompts", "attempt"), "list[dict]"),
    PathFlag("--custom-generate-function-path", ("args", "engines", "request"), "GenerateResult"),
    PathFlag("--custom-rm-path", ("args", "samples"), "list[float]"),
    PathFlag("--dynamic-sampling-filter-path", ("args", "group"), "bool", "scores_rewards"),
    PathFlag("--rollout-sample-filter-path", ("args", "samples"), "None", "scores_rewards"),
    PathFlag("--custom-reward-post-process-path", ("args", "samples", "rewards"), "advantages", "scores_rewards"),
    PathFlag(
        "--custom-convert-samples-to-train-data-path",
        ("args", "result", "advantages"),
        "TrainPairs",
    ),
    PathFlag(
        "--diffusion-step-strategy-path",
        ("args", "rollout_id", "num_steps"),
        "list[int]",
        "samples_sde",
    ),
    PathFlag("--eval-function-path", ("args", "engines", "rollout_id"), "dict[str, float]"),
)


def add_rollout_step_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rollout steps (module.fn or file.py:fn; see docs/user-guide/customization.md)")
    group.add_argument(
        "--rollout-function-path", default=None, help="The whole rollout: fn(args, rollout_id, manager)."
    )
    group.add_argument(
        "--data-source-path", default=None, help="Prompt records: fn(args, rollout_id, num_prompts, attempt)."
    )
    group.add_argument(
        "--custom-generate-function-path", default=None, help="Generation: fn(args, engines, request) -> result."
    )
    group.add_argument(
        "--dynamic-sampling-filter-path",
        default=None,
        help="Keep a prompt group? fn(args, group) -> bool; dropped groups are refilled with new prompts.",
    )
    ReadBy(group, ByFlag("dynamic_sampling_filter_path")).add_argument(
        "--dynamic-sampling-max-rounds",
        type=int,
        default=4,
        help="Refill rounds after dynamic-sampling drops before the batch is completed with dropped groups.",
    )
    group.add_argument(
        "--rollout-sample-filter-path",
        default=None,
        help="fn(args, samples) sets sample.remove_sample: those train with advantage 0.",
    )
    group.add_argument(
        "--custom-convert-samples-to-train-data-path",
        "--custom-expand-samples-to-train-pairs-path",
        dest="custom_convert_samples_to_train_data_path",
        default=None,
        help="Samples -> train pairs: fn(args, result, advantages) -> pairs.",
    )
    group.add_argument("--eval-function-path", default=None, help="Eval: fn(args, engines, rollout_id) -> metrics.")


def rollout_step_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """Parse time: a path flag the run never reads is an error (it would be silently ignored)."""
    errors = []
    for spec in PATH_FLAGS:
        if not getattr(args, spec.dest, None):
            continue
        if args.train_only:
            errors.append(
                f"{spec.flag} replaces a rollout step; --train-only ({args.loss_type}) has no generating rollout"
            )
        elif spec.needs is not None and not getattr(algorithm, spec.needs):
            errors.append(f"{spec.flag} is not read under --loss-type {algorithm.name}: it needs {NEEDS[spec.needs]}")
    return errors


def check_signature(spec: PathFlag, fn: Callable[..., Any], path: str) -> None:
    """The function must take the flag's positional parameters (by position, or through *args)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind in (p.KEYWORD_ONLY,)]
    wanted = len(spec.params)
    if len(positional) < wanted or len([p for p in positional if p.default is p.empty]) > wanted or required:
        got = ", ".join(p.name for p in params) or "nothing"
        raise HookLoadError(
            f"{spec.flag} {path}: takes ({got}); it is called as {spec.signature} "
            "(see docs/user-guide/customization.md)"
        )


def load_path_flags(args: argparse.Namespace) -> dict[str, Callable[..., Any]]:
    """Every path flag given, loaded and signature-checked: {dest: function}. Errors name the flag and the file."""
    loaded = {}
    for spec in PATH_FLAGS:
        path = getattr(args, spec.dest, None)
        if not path:
            continue
        try:
            fn = load_function(path)
        except HookLoadError as exc:
            raise HookLoadError(f"{spec.flag}: {exc}") from exc
        check_signature(spec, fn, path)
        loaded[spec.dest] = fn
    return loaded
