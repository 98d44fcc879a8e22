"""Where each role saves and resumes: one lock and one latest pointer per save folder, and the roles' agreement on
the rollout a run resumes at (a role other than the actor may use its own folders: `--<role>-save/-load`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from miles.algorithms import role_dest, role_flag, training_order
from miles.backends.fsdp_utils.checkpoint import (
    DCP_DIR,
    META_FILE,
    CheckpointError,
    checkpoint_dir,
    read_dcp_metadata,
    read_extra,
    read_latest,
    write_latest,
)
from miles.utils.locks import FolderLocks

logger = logging.getLogger(__name__)


class ResumeMismatchError(RuntimeError):
    """The roles' load folders point at different rollouts; the message names roles, folders and rollouts."""


UNKNOWN = "unknown"  # what a checkpoint was trained with, when it cannot be told


class ResumeSettingsError(RuntimeError):
    """A checkpoint trained otherwise than this run would (a LoRA adapter vs full weights, another adapter rank);
    the message names the flag that differs and the folder."""


def save_folders(args: argparse.Namespace, roles: list[str]) -> dict[str, str]:
    """role -> the folder it saves into, for the roles that save (`--save`, `--<role>-save`)."""
    folders = {role: getattr(args, role_dest(role, "save")) for role in roles}
    return {role: folder for role, folder in folders.items() if folder}


def load_folders(args: argparse.Namespace, roles: list[str]) -> dict[str, str | None]:
    return {role: getattr(args, role_dest(role, "load")) for role in roles}


def lock_save_folders(args: argparse.Namespace) -> FolderLocks:
    """Take the save folders of every role of the run for its lifetime; a second run on one of them fails here,
    naming the flag and the holder."""
    folders = save_folders(args, training_order(args))
    return FolderLocks((role_flag(role, "save"), folder) for role, folder in folders.items())


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
        flag, folder = role_flag(role, "load"), folders[role]
        source = f"{flag} {folder}" if folder else f"no {flag}"
        state = f"resumes after rollout {starts[role] - 1}" if starts[role] > 0 else "starts fresh at rollout 0"
        parts.append(f"{role} {state} ({source})")
    flags = " and ".join(role_flag(role, "load") for role in reversed(roles))  # the actor's --load first
    raise ResumeMismatchError(
        f"the roles do not agree where to resume: {'; '.join(parts)}. Point {flags} at checkpoints of the same run "
        "(each save folder has its own latest_checkpointed_iteration.txt)"
    )


def saved_lora_rank(role_dir: str) -> int | None | str:
    """The adapter rank a role's checkpoint was trained with: None for full weights, UNKNOWN when it cannot be
    told (an unfinished or damaged save: the load names it). meta.json records it (`lora_rank`); a checkpoint from
    before that is told by its stored keys (an adapter's `lora_A` weights, rank their first dimension)."""
    try:
        with open(os.path.join(role_dir, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return UNKNOWN
    if isinstance(meta, dict) and "lora_rank" in meta:
        return meta["lora_rank"]
    try:
        stored = read_dcp_metadata(os.path.join(role_dir, DCP_DIR, ".metadata")).state_dict_metadata
    except (OSError, CheckpointError):
        return UNKNOWN
    adapters = [entry for key, entry in stored.items() if ".lora_A." in key and key.endswith(".weight")]
    return int(adapters[0].size[0]) if adapters else None


def check_resume_settings(args: argparse.Namespace, roles: list[str]) -> None:
    """Before any actor starts: each role resumes a checkpoint trained the way this run trains, LoRA adapter or
    full weights (--use-lora) and the adapter's rank (--lora-rank); otherwise one line names the flag to change."""
    folders = load_folders(args, roles)
    for role, rollout_id in saved_rollouts(args, roles).items():
        folder = folders[role]
        if rollout_id is None or folder is None:  # a rollout is read from a folder only
            continue
        flag = role_flag(role, "load")
        rank = saved_lora_rank(checkpoint_dir(folder, rollout_id, role))
        where = f"{flag} {folder} (rollout {rollout_id}, {role})"
        if rank == UNKNOWN or rank == (args.lora_rank if args.use_lora else None):
            continue
        if rank is None:
            raise ResumeSettingsError(
                f"{where} holds full weights, and --use-lora would train a LoRA adapter on them: resume it without "
                "--use-lora"
            )
        if not args.use_lora:
            raise ResumeSettingsError(
                f"{where} holds a rank-{rank} LoRA adapter, not full weights: resume it with --use-lora --lora-rank "
                f"{rank}"
            )
        raise ResumeSettingsError(
            f"{where} holds a rank-{rank} LoRA adapter, and this run has --lora-rank {args.lora_rank}: resume it "
            f"with --lora-rank {rank}"
        )


def check_data_source_resume(load_dir: str, start_rollout_id: int, source: Any) -> None:
    """Warn when a resumed run would not continue the saved prompt stream (other data, seed or batch size)."""
    extra = read_extra(load_dir, start_rollout_id - 1, "actor") or {}
    state = extra.get("data_source")
    if state is None:
        logger.warning(
            "%s holds no data-source state: cannot confirm that rollout %d continues the saved prompt stream",
            load_dir,
            start_rollout_id,
        )
        return
    mismatches = source.resume_mismatches(state, start_rollout_id)
    if mismatches:
        logger.warning(
            "resuming from %s with different prompt data or settings; the prompt stream will not continue the "
            "saved one (%s)",
            load_dir,
            "; ".join(mismatches),
        )
    else:
        logger.info("prompt stream resumes at rollout %d (epoch %d)", start_rollout_id, state["epoch"])
