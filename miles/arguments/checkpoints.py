"""The flags of checkpoints and of what survives a lost actor or a stop signal (saves, resumes, --max-restarts and
its wait, --restart-min-dp-size, --stop-grace-s), read by the checkpoint code (miles/backends/fsdp_utils/checkpoint.py),
the restarts (miles/ray/restarts.py) and the stop signals (miles/utils/stop_signals.py), and their rules."""

from __future__ import annotations

import argparse

from miles.arguments.flag_readers import ByFlag, ReadBy


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
    group.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="When an actor dies (trainer rank, rollout engine, reward worker; a lost node): tear the groups down, "
        "wait for the resources, start them again and resume from the latest checkpoint in --save, at most N times "
        "(docs/user-guide/failures.md). Needs --save; pair it with --save-interval.",
    )
    ReadBy(group, ByFlag("max_restarts", "--max-restarts N above 0")).add_argument(
        "--restart-timeout",
        type=float,
        default=600.0,
        help="With --max-restarts: seconds a restart waits for the cluster to hold the run's CPUs / GPUs again "
        "before the run fails with the actor's error.",
    )
    ReadBy(group, ByFlag("max_restarts", "--max-restarts N above 0")).add_argument(
        "--restart-min-dp-size",
        type=int,
        default=None,
        help="With --max-restarts: when the cluster does not hold the run's resources again within --restart-timeout "
        "(a node lost for good), restart at the largest --dp-size from N up that it holds and that divides "
        "--global-batch-size (and keeps --fsdp-shard-size; on CUDA the plan must fit), resuming the checkpoint "
        "resharded. Default: the run fails instead. Not with --colocate.",
    )
    group.add_argument(
        "--stop-grace-s",
        type=float,
        default=300.0,
        help="After a first SIGTERM / SIGINT (preemption, Ctrl-C): seconds the driver has to finish the phase under "
        "way, save and stop (exit code 75) before it exits at once (143) with the last complete checkpoint the latest; "
        "set it below the scheduler's grace period (docs/user-guide/failures.md).",
    )


def restart_rules(args: argparse.Namespace) -> list[str]:
    """A restart resumes every trained role from its save folder (a role's --<role>-save defaults to --save)."""
    errors = []
    if args.max_restarts > 0 and not args.save:
        errors.append(
            f"--max-restarts {args.max_restarts} resumes from the latest checkpoint in --save: pass --save DIR"
        )
    floor = args.restart_min_dp_size
    if floor is not None and floor > args.dp_size:
        errors.append(
            f"--restart-min-dp-size {floor} is above --dp-size {args.dp_size}: a restart only shrinks the run"
        )
    if floor is not None and args.colocate:
        errors.append("--restart-min-dp-size with --colocate: the engines share the ranks' GPUs; the run cannot shrink")
    return errors
