"""Resumable checkpoints (ARCHITECTURE §10): `SAVE_DIR/iter_{rollout_id:07d}/{role}/` holding a sharded DCP save of
model + optimizer, the LR schedule, per-rank RNG and an `extra` dict (JSON + safetensors, no pickled code), a manifest
of every file's size and CRC32, and `meta.json` (written last); plus each save folder's latest-iteration pointer.

`save_checkpoint` and `load_checkpoint` run their named steps (`checkpoint_save`, `checkpoint_load`); the layout
(folder and file names) is `checkpoint_layout`'s."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from miles.backends.fsdp_utils.checkpoint_files import (
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_sizes,
    encode_tree,
    read_dcp_metadata,
    read_manifest,
    read_tree,
)
from miles.backends.fsdp_utils.checkpoint_files import verify_checksums as verify_checksums_of
from miles.backends.fsdp_utils.checkpoint_layout import (
    DCP_DIR,
    EXTRA_STEM,
    LATEST_FILE,
    META_FILE,
    TRAINED_ONLY,
    atomic_write_text,
    barrier,
    checkpoint_dir,
    current_rank,
    current_world_size,
)
from miles.backends.fsdp_utils.checkpoint_load import check_role_dir, read_small_files, restore, state_to_load
from miles.backends.fsdp_utils.checkpoint_save import (
    check_meta_argument,
    meta_record,
    prepare_role_dir,
    write_manifest,
    write_state,
)
from miles.backends.fsdp_utils.checkpoint_space import (
    SaveTarget,
    attempt,
    folder_bytes,
    tensor_bytes,
    warn_if_next_wont_fit,
    warn_if_short,
)
from miles.backends.fsdp_utils.ema import local_tensor
from miles.utils.distributed import collective_device
from miles.utils.weight_checksum import checksum_terms

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load_checkpoint` hands back besides the restored objects: the resumed rollout, `extra`, meta.json."""

    rollout_id: int
    extra: dict[str, Any] | None
    meta: dict[str, Any]


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
    barrier()
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
    if current_rank() == 0:
        atomic_write_text(os.path.join(save_dir, LATEST_FILE), f"{rollout_id}\n")
    barrier()


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
    """The `extra` dict a role saved at `rollout_id` (None if it saved none), checked against the manifest, without
    touching the model."""
    _, path = _resolve_checkpoint(load_dir, role, rollout_id)
    manifest = read_manifest(path)
    names = [n for n in manifest if n.startswith(EXTRA_STEM + ".")]
    if not names:
        return None
    check_sizes(path, manifest, names)
    verify_checksums_of(path, manifest, names)
    return read_tree(os.path.join(path, EXTRA_STEM))


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
    save_flag: str = "--save",
) -> str:
    """Save one role's training state (collective: every rank of the group calls it). Returns the role dir.

    `extra` (data-source state, ...) must be the same on every rank, JSON data or full tensors: rank 0 writes it.
    `sharded` (EMA / old-policy shadow weights, ...) holds per-rank DTensor state saved with the model by DCP.
    `meta.json` is written last, so a role dir without it is an unfinished save. The latest pointer is not touched:
    the driver calls `write_latest` once every group has saved. A save that fails on any rank is removed on every
    rank together (`SaveTarget.settle`); a full device raises `CheckpointSpaceError` naming `save_flag`, the
    iteration and the bytes. A device with less free space than the save needs is warned about before it starts.
    """
    check_meta_argument(meta)
    # encoded before any collective, so a bad `extra` fails on every rank and leaves nothing on disk
    encoded_extra = encode_tree(extra, "extra") if extra is not None else None
    encoded_schedule = encode_tree(lr_scheduler.state_dict(), "lr_scheduler") if lr_scheduler is not None else None
    path = checkpoint_dir(save_dir, rollout_id, role)
    rank, world_size = current_rank(), current_world_size()
    frozen = frozen_weights_digest(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    state = {"model": model_state, "optimizer": optim_state, **(sharded or {})}
    target = _save_target(save_dir, rollout_id, role, state, save_flag)
    if rank == 0:
        warn_if_short(save_flag, save_dir, target.needed, rollout_id)
    target.settle(attempt(prepare_role_dir, path, rank))
    target.settle(attempt(write_state, path, rank, state, encoded_schedule, encoded_extra))
    write_manifest(path, rank, world_size, target)
    meta_text = meta_record(rollout_id, role, world_size, model, frozen, meta)  # last: the role dir is then whole
    target.settle(attempt(atomic_write_text, os.path.join(path, META_FILE), meta_text) if rank == 0 else None)
    if rank == 0:
        warn_if_next_wont_fit(save_flag, save_dir, folder_bytes(path), rollout_id)
    logger.info("saved %s checkpoint of rollout %d to %s", role, rollout_id, path)
    return path


def _save_target(save_dir: str, rollout_id: int, role: str, state: dict[str, Any], save_flag: str) -> SaveTarget:
    """The save's `SaveTarget`: about what it takes (the latest checkpoint of this role in `save_dir`, else every
    rank's tensors: their shards are alike in size) and the latest iteration it must leave intact."""
    try:
        latest = read_latest(save_dir) if os.path.isdir(save_dir) else None
    except ValueError:
        latest = None
    previous = folder_bytes(checkpoint_dir(save_dir, latest, role)) if latest is not None else 0
    needed = previous or tensor_bytes([state]) * current_world_size()
    return SaveTarget(save_flag, save_dir, rollout_id, checkpoint_dir(save_dir, rollout_id, role), needed, latest)


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
    verify_checksums: bool = True,
) -> LoadedCheckpoint:
    """Restore one role's state saved by `save_checkpoint` (collective); `rollout_id=None` reads the latest pointer.

    Restores model, optimizer and LR schedule (the last two only with `load_optimizer`) and this rank's RNG;
    returns the rollout id, the `extra` dict (None if none was saved) and meta.json. At another world size (more or
    fewer ranks, another mesh) DCP reshards the parameters, optimizer state and `sharded` shadows; the per-rank RNG
    streams are then not restored (the ranks keep their start's: miles draws every pair's noise from its own seeded
    stream, not from them). Refused up front: another model (meta.json's identity), a file missing or of the wrong size.
    Every file's CRC32 is checked against the manifest (the shards in a thread beside the load, split over the
    ranks) unless `verify_checksums=False`. The ranks decide together whether all loaded (one all-gather), so a
    failure on one rank raises on every rank, naming the file, instead of leaving the others waiting.
    """
    rank = current_rank()
    frozen = frozen_weights_digest(model)  # collective: every rank, before anything that may fail on one
    error: BaseException | None = None
    hashing = None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-verify")
    path = load_dir
    try:
        found, path = _resolve_checkpoint(load_dir, role, rollout_id)
        meta, manifest, shared = check_role_dir(path, role, found, model, frozen)
        shards = [n for n in shared if n.startswith(DCP_DIR + "/") and n.endswith(".distcp")]
        if verify_checksums:  # the small files are parsed, so they are checked before; the shards beside the load
            verify_checksums_of(path, manifest, [n for n in shared if n not in shards])
            hashing = pool.submit(verify_checksums_of, path, manifest, shards[rank :: current_world_size()])
        state = state_to_load(model, optimizer, sharded, load_optimizer=load_optimizer)
        read_dcp_metadata(os.path.join(path, DCP_DIR, ".metadata"))  # refused here, alike on every rank
        dcp.load(state, storage_reader=SafeFileSystemReader(os.path.join(path, DCP_DIR)), planner=SafeLoadPlanner())
        rng_rank = rank if meta["world_size"] == current_world_size() else None  # streams of another layout: none
        with_schedule = load_optimizer and lr_scheduler is not None
        rng, schedule, extra = read_small_files(
            path, manifest, rng_rank, with_schedule=with_schedule, verify=verify_checksums
        )
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        error = err
    finally:
        if hashing is not None:  # a damaged shard explains whatever the load made of it: it is the error to name
            damaged = hashing.exception()
            if damaged is not None:
                damaged.__context__, error = error, damaged
        pool.shutdown(wait=True)
    _decide_together(error, role, path)

    restore(model, optimizer, lr_scheduler, state, schedule, rng, load_optimizer=load_optimizer)
    logger.info("loaded %s checkpoint of rollout %d from %s", role, found, path)
    if rng is None and rank == 0:
        _warn_resharded(role, path, meta["world_size"])
    return LoadedCheckpoint(rollout_id=found, extra=extra, meta=meta)


def _warn_resharded(role: str, path: str, saved_by: int) -> None:
    logger.warning(
        "the %s checkpoint %s was saved by %d ranks and loads into %d: parameters, optimizer state and shadows "
        "resharded; the per-rank RNG streams are not restored (each rank keeps its start's; a hook that draws from "
        "torch's, numpy's or python's global generator draws as in a fresh run)",
        role, path, saved_by, current_world_size(),
    )  # fmt: skip


def _decide_together(error: BaseException | None, role: str, path: str) -> None:
    """One all-gather of every rank's outcome: all loaded, or every rank raises the most telling failure."""
    if current_world_size() == 1:
        if error is not None:
            error.add_note(f"while loading the {role} checkpoint {path}")
            raise error
        return
    mine = None if error is None else (isinstance(error, CheckpointError), f"{type(error).__name__}: {error}")
    outcomes: list = [None] * current_world_size()
    dist.all_gather_object(outcomes, mine)
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return
    # a named damaged / foreign file first: the other ranks' errors are often its consequences
    rank, (_, message) = min(failed, key=lambda item: (not item[1][0], item[0]))
    raise CheckpointError(f"loading the {role} checkpoint {path} failed on rank {rank}: {message}") from error


def frozen_weights_digest(model: nn.Module) -> dict[str, int]:
    """Count, elements and the exact 16-bit word sum (`weight_checksum`) of the frozen parameters over one copy of
    the model (collective): a sharded parameter's word sums are added over the ranks that hold its distinct shards
    (the shard group of a 2-D mesh, not its replicas), one a rank holds whole counts once. Integer sums, so the same
    whatever the sharding, the shard size or the device."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    device = collective_device()
    sums: dict[Any, torch.Tensor] = {}  # process group (None: held whole) -> word sum; first-seen order on every rank
    for param in frozen:  # the terms stay on the device until the sums: one transfer
        group = _shard_group(param)
        term = checksum_terms([local_tensor(param)])[0].to(device)
        sums[group] = sums[group] + term if group in sums else term
    words = sums.pop(None, torch.zeros((), dtype=torch.int64, device=device))
    for group, value in sums.items():
        dist.all_reduce(value, group=group)
        words = words + value
    return {"tensors": len(frozen), "elements": sum(p.numel() for p in frozen), "words": int(words.item())}


def _shard_group(param: torch.Tensor) -> Any:
    """The process group over which `param`'s distinct shards lie; None when this rank holds it whole."""
    if not isinstance(param, DTensor) or current_world_size() == 1:
        return None
    dims = [i for i, placement in enumerate(param.placements) if placement.is_shard()]
    if len(dims) > 1:
        raise ValueError(f"a frozen parameter sharded on mesh dims {dims}: FSDP2 shards on one")
    return param.device_mesh.get_group(dims[0]) if dims else None
