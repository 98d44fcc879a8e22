"""The steps of `save_checkpoint` (`miles.backends.fsdp_utils.checkpoint`): its arguments checked before any
collective, the role dir emptied, the state written (DCP, RNG, LR schedule, `extra`), the manifest of sizes and
CRC32s, and the meta.json record written last."""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn

from miles import __version__
from miles.backends.fsdp_utils.checkpoint_files import (
    MANIFEST_FILE,
    describe_files,
    encode_tree,
    list_files,
    model_identity,
    rng_state,
    write_tree,
)
from miles.backends.fsdp_utils.checkpoint_layout import (
    DCP_DIR,
    EXTRA_STEM,
    LR_SCHEDULER_STEM,
    META_FILE,
    RESERVED_META,
    atomic_write_text,
    rng_stem,
)
from miles.backends.fsdp_utils.checkpoint_space import SaveTarget, attempt


def check_meta_argument(meta: dict[str, Any] | None) -> None:
    """`save_checkpoint`'s `meta`: no key miles writes itself, and JSON data (checked on every rank before any
    collective, not on rank 0 at the end)."""
    clashes = sorted(set(meta or {}) & set(RESERVED_META))
    if clashes:
        raise ValueError(f"save_checkpoint: meta keys {clashes} are reserved (miles writes {list(RESERVED_META)})")
    try:
        json.dumps(meta)
    except TypeError as err:
        raise TypeError(f"save_checkpoint: meta must be JSON-serialisable for meta.json: {err}") from None


def prepare_role_dir(path: str, rank: int) -> None:
    """Re-saving an iteration: it is incomplete until the new meta.json lands, and no stale file may survive."""
    os.makedirs(path, exist_ok=True)
    if rank == 0:
        for name in [META_FILE, *os.listdir(path)]:
            target = os.path.join(path, name)
            if os.path.isdir(target):
                shutil.rmtree(target)
            elif os.path.exists(target):
                os.remove(target)


def write_state(path: str, rank: int, state: dict[str, Any], schedule: Any, extra: Any) -> None:
    """The sharded state (DCP, collective), this rank's RNG streams, and on rank 0 the LR schedule and `extra`."""
    dcp.save(state, checkpoint_id=os.path.join(path, DCP_DIR))
    write_tree(encode_tree(rng_state(), "rng"), os.path.join(path, rng_stem(rank)))
    if rank == 0:
        if schedule is not None:
            write_tree(schedule, os.path.join(path, LR_SCHEDULER_STEM))
        if extra is not None:
            write_tree(extra, os.path.join(path, EXTRA_STEM))


def write_manifest(path: str, rank: int, world_size: int, target: SaveTarget) -> None:
    """Size and CRC32 of every file; the ranks hash their share of the files and rank 0 writes the list."""
    mine: dict[str, dict[str, Any]] | None = None
    error: BaseException | None = None
    try:
        names = list_files(path, skip=(MANIFEST_FILE, META_FILE))
        mine = describe_files(path, names[rank::world_size])
    except OSError as err:
        error = err
    shares = target.settle(error, mine)  # every rank's share, once every rank has hashed its own
    error = None
    if rank == 0:
        files = {name: entry for share in shares for name, entry in share.items()}
        text = json.dumps({"algorithm": "crc32", "files": dict(sorted(files.items()))}, indent=1) + "\n"
        error = attempt(atomic_write_text, os.path.join(path, MANIFEST_FILE), text)
    target.settle(error)


def meta_record(
    rollout_id: int, role: str, world_size: int, model: nn.Module, frozen: dict[str, int], meta: dict[str, Any] | None
) -> str:
    """meta.json's text: the save's place, ranks, miles version and time, the model's identity, the frozen weights'
    digest, then the caller's `meta`."""
    record = {
        "rollout_id": rollout_id,
        "role": role,
        "world_size": world_size,
        "miles_version": __version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": model_identity(model),
        "frozen_weights": frozen,
        **(meta or {}),
    }
    return json.dumps(record, indent=2) + "\n"
