"""The flags of what a tripped reward-hacking monitor does (`--monitor-action`) and of the proxy-gold divergence
monitor (`--gold-rm-type`), read by the guard (miles/rollout/guard.py, miles/ray/monitor_guard.py), and their rules."""

from __future__ import annotations

import argparse
import importlib.util

from miles.algorithms import Algorithm, role_dest, role_flag, training_order
from miles.arguments.flag_readers import ByFlag, ReadBy
from miles.arguments.reward_spec import (
    CUSTOM,
    REWARD_PACKAGES,
    parse_reward_spec,
    reward_model_problems,
    reward_spec_from_args,
    runs_rewards,
    shapes_learned_problems,
)


def add_guard_arguments(group: argparse._ArgumentGroup) -> None:
    """What a tripped monitor does and the proxy-gold divergence monitor (miles/rollout/guard.py)."""
    group.add_argument(
        "--monitor-action",
        choices=("warn", "stop", "rollback"),
        default="warn",
        help="When a monitor trips: warn (once per condition per run), stop (end the run cleanly after the rollout, "
        "checkpoints kept), or rollback (restore the last checkpoint saved before the weights that tripped, then go "
        "on at a lower learning rate or stop: --monitor-after-rollback; needs --save and --save-interval).",
    )
    group.add_argument(
        "--monitor-after-rollback",
        choices=("continue", "stop"),
        default="continue",
        help="After a rollback: continue with every role's learning rate times --monitor-rollback-lr-factor, or stop.",
    )
    group.add_argument(
        "--monitor-rollback-lr-factor",
        type=float,
        default=0.5,
        help="The factor on every role's learning rate (and its schedule) after a rollback that continues.",
    )
    group.add_argument(
        "--monitor-max-rollbacks",
        type=int,
        default=2,
        help="Rollbacks that continue; the next trip restores the checkpoint and stops the run.",
    )
    group.add_argument(
        "--gold-rm-type",
        default=None,
        help="The proxy-gold divergence monitor: a second reward (the --rm-type syntax) scored on the eval samples "
        "only, never trained on; logged as eval/gold_reward beside eval/proxy_reward (the trained reward on the same "
        "samples). It trips when the proxy rose while the gold fell by more than --monitor-gold-margin.",
    )
    gold = ReadBy(group, ByFlag("gold_rm_type"))
    gold.add_argument(
        "--monitor-gold-margin",
        type=float,
        default=0.05,
        help="How far (in the gold's units) the gold must fall below the best of the last --monitor-gold-window "
        "evals, the proxy above that eval's, to trip.",
    )
    gold.add_argument(
        "--monitor-gold-window",
        type=int,
        default=3,
        help="How many earlier evals the proxy-gold monitor compares the latest with.",
    )


def monitor_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    """--monitor-action rollback needs checkpoints to restore; --gold-rm-type needs the eval's samples and a reward
    the run does not train on (checked with the computed defaults: the eval interval)."""
    errors = []
    if args.monitor_action == "rollback":
        unsaved = [
            role_flag(role, "save") for role in training_order(args) if not getattr(args, role_dest(role, "save"))
        ]
        if unsaved:
            errors.append(f"--monitor-action rollback restores checkpoints: pass {' and '.join(unsaved)} DIR")
        elif args.save_interval is None:
            errors.append(
                "--monitor-action rollback restores a checkpoint saved before the trip, and without --save-interval "
                "the run saves only at its end: pass --save-interval N"
            )
        if args.debug_rollout_only:
            errors.append(
                "--monitor-action rollback restores the trainer's checkpoints; --debug-rollout-only trains none"
            )
        if args.async_rollout:
            errors.append(
                "--monitor-action rollback cannot undo the rollout --async-rollout already generated ahead: use "
                "--monitor-action stop or drop --async-rollout"
            )
    return errors + gold_rules(args, algorithm)


def gold_rules(args: argparse.Namespace, algorithm: Algorithm) -> list[str]:
    if not args.gold_rm_type:
        return []
    if not runs_rewards(args, algorithm.scores_rewards):
        return [
            f"--gold-rm-type is compared with the reward the run trains on; --loss-type {algorithm.name} scores none"
        ]
    try:
        gold = [name for name, _ in parse_reward_spec(args.gold_rm_type)]
    except ValueError as exc:
        return [str(exc).replace("--rm-type", "--gold-rm-type", 1)]  # the same grammar, the gold's flag named
    errors = []
    if args.eval_interval is None or args.eval_function_path:
        errors.append(
            "--gold-rm-type scores the held-out eval's samples: pass --eval-interval N (and no --eval-function-path)"
        )
    if CUSTOM in gold:
        errors.append("--gold-rm-type takes built-in rewards (--custom-rm-path is the trained reward's)")
    try:
        trained = [name for name, _ in reward_spec_from_args(args)]
    except ValueError:
        return errors  # reward_rules names the problem
    shared = [name for name in gold if name in trained]
    if shared:
        errors.append(
            f"--gold-rm-type {args.gold_rm_type}: {', '.join(shared)} is trained on (--rm-type); the gold must be a "
            "reward the run never trains on"
        )
    spec = parse_reward_spec(args.gold_rm_type)
    missing = [
        name for name in gold if name in REWARD_PACKAGES and importlib.util.find_spec(REWARD_PACKAGES[name][0]) is None
    ]
    errors += [
        f"--gold-rm-type {name} needs the {REWARD_PACKAGES[name][0]} package: {REWARD_PACKAGES[name][1]}"
        for name in missing
    ]
    return errors + reward_model_problems(args, spec) + shapes_learned_problems(args, spec)
