"""The run's roles: their training order, each role's settings (the actor's own flags or its `--<role>-*`
overrides), the override flags the parser adds for every registered role, the rules on them and their defaults."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable
from typing import Any

from miles.algorithms.base import ROLE_OVERRIDES, Algorithm, Computed, Role, role_dest, role_flag
from miles.algorithms.registry import algorithm_of

OVERRIDE_TYPES = {"lr": float, "num_steps_per_rollout": int, "micro_batch_size": int}
OVERRIDE_HELP = {
    "checkpoint": "initial weights",
    "lr": "peak learning rate",
    "load": "checkpoint dir to resume from",
    "save": "checkpoint dir",
    "num_steps_per_rollout": "optimizer steps per rollout",
    "micro_batch_size": "train pairs per forward/backward",
}


def training_order(args: argparse.Namespace) -> list[str]:
    """The run's roles in the order they train each rollout (a critic before the actor it scores for)."""
    return algorithm_of(args).role_names


def trained_roles(args: argparse.Namespace) -> list[str]:
    """The roles this run starts groups for: none for debug rollouts or evaluating the pipeline as loaded."""
    return [] if args.debug_rollout_only or (args.eval_only and not args.load) else training_order(args)


def role_settings(args: argparse.Namespace, role: str) -> dict[str, Any]:
    """What differs between roles, override -> value (§8: everything else is shared); defaults filled at parse."""
    return {override: getattr(args, role_dest(role, override), None) for override in ROLE_OVERRIDES}


def extra_roles(algorithms: Iterable[Algorithm]) -> dict[str, list[Algorithm]]:
    """Each non-actor role name -> the algorithms that declare one."""
    holders: dict[str, list[Algorithm]] = {}
    for algorithm in algorithms:
        for role in algorithm.roles:
            if role.overridable:
                holders.setdefault(role.name, []).append(algorithm)
    return holders


def default_says(role: Role, override: str) -> str:
    spec = role.defaults.get(override)
    if isinstance(spec, Computed):
        return spec.says
    if isinstance(spec, str):
        return "--" + spec.replace("_", "-")
    if override == "load":
        return f"--load; {role.flag('save')} when that differs from --save and --load is given"
    return role_flag("actor", override)


def add_role_arguments(parser: argparse.ArgumentParser, algorithms: Iterable[Algorithm]) -> None:
    """`--<role>-*` for every non-actor role of `algorithms`, once per role name."""
    for name, holders in extra_roles(algorithms).items():
        owners = ", ".join(a.name for a in holders)
        group = parser.add_argument_group(f"{name} overrides ({owners}; everything else is shared with the actor)")
        for override in ROLE_OVERRIDES:
            says = {a.name: default_says(a.role(name), override) for a in holders}
            text = (
                next(iter(says.values()))
                if len(set(says.values())) == 1
                else "; ".join(f"{k}: {v}" for k, v in says.items())
            )
            try:
                group.add_argument(  # type=None (no conversion) is argparse's default; typeshed leaves None out
                    role_flag(name, override),
                    type=OVERRIDE_TYPES.get(override),  # type: ignore[arg-type]
                    default=None,
                    help=f"The {name}'s {OVERRIDE_HELP[override]} (default: {text}).",
                )
            except argparse.ArgumentError as exc:
                raise ValueError(f"the {name!r} role of {owners}: {exc}") from exc


def override_rules(args: argparse.Namespace, algorithms: Iterable[Algorithm]) -> list[str]:
    """A role's overrides given under an algorithm without that role (they would be ignored)."""
    run = algorithm_of(args)
    errors = []
    for name, holders in extra_roles(algorithms).items():
        given = [role_flag(name, o) for o in ROLE_OVERRIDES if getattr(args, role_dest(name, o), None) is not None]
        if given and name not in run.role_names:
            errors.append(
                f"{', '.join(given)} only apply to an algorithm with a {name} role "
                f"({', '.join(a.name for a in holders)}); --loss-type {run.name} trains {', '.join(run.role_names)}"
            )
    return errors


def folder_rules(args: argparse.Namespace) -> list[str]:
    """Each role's load folder must exist unless it is the role's save folder (auto-resume); its save folder, and
    the run's other output folders, must be folders this process can make and write (the run would fail making or
    writing one after its checks, with the OS's bare error)."""
    problems: dict[str, tuple[str, str]] = {}  # path -> (the first flag naming it, its problem)
    for flag, path in output_folders(args):
        if path and path not in problems and (problem := folder_problem(path)):
            problems[path] = (flag, problem)
    errors = [f"{flag} {path}: {problem}" for path, (flag, problem) in problems.items()]
    for role in algorithm_of(args).roles:
        load, save = getattr(args, role.dest("load")), getattr(args, role.dest("save"))
        if load and not os.path.isdir(load) and load != save:
            errors.append(
                f"{role.flag('load')} {load}: directory not found (pass {role.flag('load')} equal to "
                f"{role.flag('save')} to auto-resume)"
            )
    return errors


def folder_problem(path: str) -> str | None:
    """Why the run cannot make or write the folder `path`; None when it can. A folder not there yet is made and
    removed again (whatever was missing of its parents too): only trying tells, whoever runs it (root's access checks
    pass where the kernel refuses a folder, as in /proc)."""
    if os.path.isfile(path):
        return "a file is there, not a folder: give a folder path"
    if os.path.isdir(path):
        return None if os.access(path, os.W_OK | os.X_OK) else "not writable by this user: give a folder you can write"
    made, parent = [], os.path.abspath(path)
    while not os.path.lexists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(path)
    except OSError as exc:
        return f"cannot be made ({exc.strerror}{f' at {exc.filename}' if exc.filename else ''}): give a folder you can write"
    finally:
        for folder in made:  # deepest first; only the (empty) folders made here
            with contextlib.suppress(OSError):  # not made, or something else wrote into it meanwhile: left as is
                os.rmdir(folder)
    return None


def output_folders(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """The folders the run writes, by flag: --output-dir, each role's save folder (the actor's first), --save-hf, a
    --prompt-cache DIR."""
    folders = [("--output-dir", args.output_dir)]
    folders += [(role.flag("save"), getattr(args, role.dest("save"))) for role in algorithm_of(args).roles[::-1]]
    folders += [("--save-hf", args.save_hf)]
    return folders + ([("--prompt-cache", args.prompt_cache)] if args.prompt_cache not in ("auto", "off") else [])


def override_default(role: Role, args: argparse.Namespace, override: str) -> Any:
    spec = role.defaults.get(override)
    if isinstance(spec, Computed):
        return spec.compute(args)
    if isinstance(spec, str):
        return getattr(args, spec)
    if override == "load":  # a role with its own save folder resumes from it (docs/user-guide/failures.md)
        save = getattr(args, role.dest("save"))
        return save if save is not None and save != args.save and args.load else args.load
    return getattr(args, role_dest("actor", override))


def role_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The computed values of the run's roles' unset overrides (from the given flags only)."""
    return {
        role.dest(override): override_default(role, args, override)
        for role in algorithm_of(args).roles
        if role.overridable
        for override in ROLE_OVERRIDES
        if getattr(args, role.dest(override), None) is None
    }
