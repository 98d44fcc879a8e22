"""Where each role saves and resumes: one lock and one latest pointer per save folder, and the roles' agreement on
the rollout a run resumes at (dmd2's actor and critic may use separate folders)."""

from __future__ import annotations

import argparse
import os

from miles.backends.fsdp_utils.checkpoint import read_latest, write_latest
from miles.utils.locks import FolderLocks

SAVE_FLAGS = {"actor": "--save", "critic": "--critic-save"}
LOAD_FLAGS = {"actor": "--load", "critic": "--critic-load"}


class ResumeMismatchError(RuntimeError):
    """The roles' load folders point at different rollouts; the message names roles, folders and rollouts."""


def trained_roles(args: argparse.Namespace) -> list[str]:
    return ["critic", "actor"] if args.loss_type == "dmd2" else ["actor"]


def save_folders(args: argparse.Namespace, roles: list[str]) -> dict[str, str]:
    """role -> the folder it saves into, for the roles that save (`--save`, `--critic-save`)."""
    folders = {"actor": args.save, "critic": getattr(args, "critic_save", None)}
    return {role: folders[role] for role in roles if folders.get(role)}


def load_folders(args: argparse.Namespace, roles: list[str]) -> dict[str, str | None]:
    folders = {"actor": args.load, "critic": getattr(args, "critic_load", None)}
    return {role: folders.get(role) for role in roles}


def lock_save_folders(args: argparse.Namespace) -> FolderLocks:
    """Take the run's save folders for its lifetime; a second run on one of them fails here, naming the holder."""
    return FolderLocks((SAVE_FLAGS[role], folder) for role, folder in save_folders(args, trained_roles(args)).items())


def write_latest_pointers(folders: dict[str, str], rollout_id: int) -> None:
    """Each save folder's latest pointer, once every role saving into it has saved `rollout_id`."""
    for folder in dict.fromkeys(folders.values()):
        write_latest(folder, rollout_id)


def saved_rollouts(args: argparse.Namespace, roles: list[str]) -> dict[str, int | None]:
    """role -> the rollout its load folder's latest pointer names (None: starts fresh)."""
    out: dict[str, int | None] = {}
    for role, folder in load_folders(args, roles).items():
        out[role] = read_latest(folder) if folder and os.path.isdir(folder) else None
    return out


def check_roles_agree(args: argparse.Namespace, roles: list[str], starts: dict[str, int] | None = None) -> None:
    """Resume only when every role resumes after the same rollout: before any actor starts (from the pointers), and
    again with what the groups loaded (`starts`: role -> first rollout to run)."""
    if starts is None:
        starts = {role: 0 if r is None else r + 1 for role, r in saved_rollouts(args, roles).items()}
    if len(set(starts.values())) <= 1:
        return
    folders = load_folders(args, roles)
    parts = []
    for role in roles:
        flag, folder = LOAD_FLAGS[role], folders[role]
        source = f"{flag} {folder}" if folder else f"no {flag}"
        state = f"resumes after rollout {starts[role] - 1}" if starts[role] > 0 else "starts fresh at rollout 0"
        parts.append(f"{role} {state} ({source})")
    raise ResumeMismatchError(
        f"the roles do not agree where to resume: {'; '.join(parts)}. Point --load and --critic-load at checkpoints "
        "of the same run (each save folder has its own latest_checkpointed_iteration.txt)"
    )
