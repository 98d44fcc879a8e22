"""Resumable checkpoints (ARCHITECTURE §10): `SAVE_DIR/iter_{rollout_id:07d}/{role}/` holding a sharded DCP save of
model + optimizer, the LR schedule, per-rank RNG, an `extra` dict and `meta.json`; plus the latest-iteration pointer."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from miles import __version__

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "meta.json"
DCP_DIR = "dcp"
LR_SCHEDULER_FILE = "lr_scheduler.pt"
EXTRA_FILE = "extra.pt"
_RESERVED_META = ("rollout_id", "role", "world_size", "miles_version", "time")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load_checkpoint` hands back besides the restored objects: the resumed rollout, `extra`, meta.json."""

    rollout_id: int
    extra: dict[str, Any] | None
    meta: dict[str, Any]


def checkpoint_dir(save_dir: str, rollout_id: int, role: str) -> str:
    return os.path.join(save_dir, f"iter_{rollout_id:07d}", role)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    save_dir: str,
    rollout_id: int,
    role: str,
    *,
    model: nn.Module,
    optimizer: Optimizer,
    lr_scheduler: LRScheduler | None,
    extra: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    sharded: dict[str, dict[str, torch.Tensor]] | None = None,
) -> str:
    """Save one role's training state (collective: every rank of the group calls it). Returns the role dir.

    `extra` (data-source state, ...) must be the same on every rank, plain or full tensors: rank 0 writes it.
    `sharded` (EMA / old-policy shadow weights, ...) holds per-rank DTensor state saved with the model by DCP. `meta.json` is written last, so a role dir without it is an unfinished save. The latest pointer
    is not touched: the driver calls `write_latest` once every group has saved.
    """
    clashes = sorted(set(meta or {}) & set(_RESERVED_META))
    if clashes:
        raise ValueError(f"save_checkpoint: meta keys {clashes} are reserved (miles writes {list(_RESERVED_META)})")
    try:
        json.dumps(meta)  # checked on every rank before any collective, not on rank 0 at the end
    except TypeError as err:
        raise TypeError(f"save_checkpoint: meta must be JSON-serialisable for meta.json: {err}") from None
    path = checkpoint_dir(save_dir, rollout_id, role)
    rank, world_size = _rank(), _world_size()
    os.makedirs(path, exist_ok=True)
    meta_path = os.path.join(path, META_FILE)
    if rank == 0:
        # Re-saving an iteration: it is incomplete until the new meta.json lands, and no stale file may survive.
        for name in (META_FILE, LR_SCHEDULER_FILE, EXTRA_FILE):
            if os.path.exists(os.path.join(path, name)):
                os.remove(os.path.join(path, name))
        shutil.rmtree(os.path.join(path, DCP_DIR), ignore_errors=True)
    _barrier()

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optim_state, **(sharded or {})},
        checkpoint_id=os.path.join(path, DCP_DIR),
    )
    torch.save(_rng_state(), os.path.join(path, f"rng_rank{rank}.pt"))
    if rank == 0:
        if lr_scheduler is not None:
            torch.save(lr_scheduler.state_dict(), os.path.join(path, LR_SCHEDULER_FILE))
        if extra is not None:
            torch.save(extra, os.path.join(path, EXTRA_FILE))
    _barrier()

    if rank == 0:
        record = {
            "rollout_id": rollout_id,
            "role": role,
            "world_size": world_size,
            "miles_version": __version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **(meta or {}),
        }
        _atomic_write_text(meta_path, json.dumps(record, indent=2) + "\n")
    _barrier()
    logger.info("saved %s checkpoint of rollout %d to %s", role, rollout_id, path)
    return path


def read_latest(load_dir: str) -> int | None:
    """The rollout id in `load_dir/latest_checkpointed_iteration.txt`, or None when that file does not exist."""
    path = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path} contains {text!r}; expected a rollout id (an integer)") from None


def write_latest(save_dir: str, rollout_id: int) -> None:
    """Point `save_dir/latest_checkpointed_iteration.txt` at `rollout_id` (atomic: tmp file + os.replace).

    Refuses unless every role dir of that iteration is complete (has meta.json). Inside a process group it is
    collective (barrier, rank 0 writes, barrier); the Ray driver, which has no group, calls it directly.
    """
    _barrier()
    # Every rank checks (same filesystem, same verdict) so that a refusal raises everywhere instead of hanging.
    iter_dir = os.path.join(save_dir, f"iter_{rollout_id:07d}")
    roles = sorted(os.listdir(iter_dir)) if os.path.isdir(iter_dir) else []
    if not roles:
        raise FileNotFoundError(f"write_latest: no checkpoint in {iter_dir}; refusing to point {LATEST_FILE} at it")
    unfinished = [role for role in roles if not os.path.isfile(os.path.join(iter_dir, role, META_FILE))]
    if unfinished:
        raise RuntimeError(
            f"write_latest: {iter_dir} has unfinished saves for roles {unfinished} (no {META_FILE}); "
            f"{LATEST_FILE} still points at the previous checkpoint"
        )
    if _rank() == 0:
        _atomic_write_text(os.path.join(save_dir, LATEST_FILE), f"{rollout_id}\n")
    _barrier()


def _read_meta(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path} has no {META_FILE}: the save did not finish; load an earlier iteration")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{meta_path} is corrupt (not valid JSON: {err})") from None
    missing = [key for key in _RESERVED_META if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise ValueError(f"{meta_path} is corrupt: missing fields {missing}")
    return meta


def _resolve_checkpoint(load_dir: str, role: str, rollout_id: int | None) -> tuple[int, str]:
    if not os.path.isdir(load_dir):
        raise FileNotFoundError(f"checkpoint directory {load_dir} does not exist")
    if rollout_id is None:
        rollout_id = read_latest(load_dir)
        if rollout_id is None:
            raise FileNotFoundError(
                f"{os.path.join(load_dir, LATEST_FILE)} does not exist: no complete checkpoint in {load_dir} "
                "(pass rollout_id to load a specific iteration)"
            )
        path = checkpoint_dir(load_dir, rollout_id, role)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{os.path.join(load_dir, LATEST_FILE)} points at rollout {rollout_id}, but {path} does not exist"
            )
        return rollout_id, path
    path = checkpoint_dir(load_dir, rollout_id, role)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no {role} checkpoint for rollout {rollout_id}: {path} does not exist")
    return rollout_id, path


def read_extra(load_dir: str, rollout_id: int, role: str) -> dict[str, Any] | None:
    """The `extra` dict a role saved at `rollout_id` (None if it saved none), without touching the model."""
    _, path = _resolve_checkpoint(load_dir, role, rollout_id)
    extra_path = os.path.join(path, EXTRA_FILE)
    return torch.load(extra_path, weights_only=False) if os.path.isfile(extra_path) else None


def load_checkpoint(
    load_dir: str,
    role: str,
    *,
    model: nn.Module,
    optimizer: Optimizer,
    lr_scheduler: LRScheduler | None,
    rollout_id: int | None = None,
    load_optimizer: bool = True,
    sharded: dict[str, dict[str, torch.Tensor]] | None = None,
) -> LoadedCheckpoint:
    """Restore one role's state saved by `save_checkpoint` (collective); `rollout_id=None` reads the latest pointer.

    Restores model, optimizer and LR schedule (the last two only with `load_optimizer`) and this rank's RNG;
    returns the rollout id, the `extra` dict (None if none was saved) and meta.json. The world size must match
    the saved one (RNG streams are per rank).
    """
    rollout_id, path = _resolve_checkpoint(load_dir, role, rollout_id)
    meta = _read_meta(path)
    meta_path = os.path.join(path, META_FILE)
    if meta["world_size"] != _world_size():
        raise ValueError(
            f"{meta_path}: saved with world size {meta['world_size']}, but the current world size is "
            f"{_world_size()}; resume with the same number of ranks"
        )
    if meta["rollout_id"] != rollout_id or meta["role"] != role:
        raise ValueError(
            f"{meta_path} records rollout {meta['rollout_id']} role {meta['role']!r}, "
            f"but it sits where rollout {rollout_id} role {role!r} belongs"
        )
    scheduler_path = os.path.join(path, LR_SCHEDULER_FILE)
    if load_optimizer and lr_scheduler is not None and not os.path.isfile(scheduler_path):
        raise FileNotFoundError(f"{scheduler_path} does not exist: the checkpoint was saved without an LR scheduler")

    dcp_path = os.path.join(path, DCP_DIR)
    if load_optimizer:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state, **(sharded or {})}
        dcp.load(state, checkpoint_id=dcp_path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if lr_scheduler is not None:
            lr_scheduler.load_state_dict(torch.load(scheduler_path, weights_only=False))
    else:
        state = {"model": get_model_state_dict(model), **(sharded or {})}
        dcp.load(state, checkpoint_id=dcp_path)
        set_model_state_dict(model, state["model"])

    _set_rng_state(torch.load(os.path.join(path, f"rng_rank{_rank()}.pt"), weights_only=False))
    extra_path = os.path.join(path, EXTRA_FILE)
    extra = torch.load(extra_path, weights_only=False) if os.path.isfile(extra_path) else None
    _barrier()
    logger.info("loaded %s checkpoint of rollout %d from %s", role, rollout_id, path)
    return LoadedCheckpoint(rollout_id=rollout_id, extra=extra, meta=meta)
