"""The disk space of a checkpoint save: what a save needs (the last checkpoint's size, else the state's), a warning
before a save that will not fit and after one that leaves no room for the next, and telling a full device from other
write failures (torch reports a full disk as a bare `inline_container` error, without ENOSPC)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

FULL_DEVICE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_DEVICE_TEXTS = ("No space left on device", "Disk quota exceeded")


class CheckpointSpaceError(OSError):
    """A save ran out of space on its device; the message names the save folder's flag, the iteration and the
    bytes, and says that the previous checkpoint is still the latest."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __reduce__(self) -> tuple[Any, ...]:  # Ray carries it from the ranks to the driver
        return type(self), (self.strerror,), self.__dict__

    def __str__(self) -> str:
        return self.strerror or ""  # always the message given (OSError types it optional)


def attempt(fn: Any, *args: Any) -> BaseException | None:
    """`fn(*args)`; the error it raised (DCP's CheckpointException, a BaseException, included), or None."""
    try:
        fn(*args)
    except (Exception, CheckpointException) as err:
        return err
    return None


def tensor_bytes(trees: Iterable[Any]) -> int:
    """Bytes of the tensors in nested dicts / lists (a DTensor counts its local shard)."""
    total, stack = 0, list(trees)
    while stack:
        item = stack.pop()
        if isinstance(item, DTensor):
            item = item.to_local()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def folder_bytes(path: str) -> int:
    """Bytes of the files under `path` (0 when it does not exist); files vanishing meanwhile are skipped."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total


def free_bytes(path: str) -> int | None:
    """Free bytes on the device of `path` (its nearest existing parent); None when the OS cannot say."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size} TB"


def warn_if_short(save_flag: str, save_dir: str, needed: int, rollout_id: int) -> None:
    """Before a save: warn when the device of `save_dir` has less free space than the save needs."""
    free = free_bytes(save_dir)
    if free is not None and free < needed:
        logger.warning(
            "%s %s: its device has %s free, and saving iteration %d needs about %s: the save will likely fail; "
            "free space there or give %s another folder",
            save_flag,
            save_dir,
            human(free),
            rollout_id,
            human(needed),
            save_flag,
        )


def warn_if_next_wont_fit(save_flag: str, save_dir: str, written: int, rollout_id: int) -> None:
    """After a save of `written` bytes: warn when the next one of that size will not fit."""
    free = free_bytes(save_dir)
    if free is not None and free < written:
        logger.warning(
            "%s %s: iteration %d took %s and its device has %s left: the next save will likely not fit; free "
            "space there (older iter_* folders can go) or give %s another folder",
            save_flag,
            save_dir,
            rollout_id,
            human(written),
            human(free),
            save_flag,
        )


def _chain(error: BaseException) -> list[BaseException]:
    """The error, its causes and contexts, and the per-rank failures a DCP CheckpointException carries."""
    seen: list[BaseException] = []
    stack: list[BaseException | None] = [error]
    while stack:
        item = stack.pop()
        if item is None or any(item is s for s in seen):
            continue
        seen.append(item)
        stack += [item.__cause__, item.__context__]
        failures = getattr(item, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, Mapping):
            stack += [f for f in failures.values() if isinstance(f, BaseException)]
    return seen


def out_of_space(error: BaseException, free: int | None, remaining: int) -> bool:
    """Whether a failed write is a full device: ENOSPC / EDQUOT (or their text) anywhere in the error, or a device
    left with less free space (`free`, measured after the failure) than the save still had to write."""
    for item in _chain(error):
        if isinstance(item, OSError) and item.errno in FULL_DEVICE_ERRNOS:
            return True
        if any(text in str(item) for text in FULL_DEVICE_TEXTS):
            return True
    return free is not None and free < remaining


def export_space_error(error: BaseException, flag: str, folder: str, needed: int) -> CheckpointSpaceError | None:
    """The error to raise for a failed export of about `needed` bytes into `folder` (`--save-hf`) when its device is
    full; None otherwise. The folder is left as it is (it may hold the user's files); checkpoints are elsewhere."""
    written = folder_bytes(folder)
    if not out_of_space(error, free_bytes(folder), max(needed - written, 1)):
        return None
    return CheckpointSpaceError(
        f"no space left on the device of {flag} {folder} while writing the trained weights (about {needed} bytes "
        f"needed: {human(needed)}; the folder now holds {human(written)}); the checkpoints of --save are untouched "
        f"and the latest holds the same weights. Free space there or give {flag} another folder"
    )


@dataclass(frozen=True)
class SaveTarget:
    """One role's save of one iteration, for `settle`: where it goes, under which flag, and about how many bytes."""

    save_flag: str
    save_dir: str
    rollout_id: int
    path: str
    needed: int
    latest: int | None  # the iteration the save folder's latest pointer names

    def settle(self, error: BaseException | None, payload: Any = None) -> list[Any]:
        """After a step of the save, on every rank (collective): every rank's `payload` when all succeeded. When
        one failed, rank 0 removes the partial role folder (and its iteration folder once empty) and every rank
        raises: `CheckpointSpaceError` when a rank's device was full, else the failing rank's own error (the
        others a RuntimeError naming it), so no rank waits for one that gave up."""
        failure = None
        if error is not None:
            remaining = max(self.needed - folder_bytes(self.path), 1)
            failure = (out_of_space(error, free_bytes(self.save_dir), remaining), f"{type(error).__name__}: {error}")
        many = dist.is_initialized() and dist.get_world_size() > 1
        outcomes: list[Any] = [(failure, payload)]
        if many:
            outcomes = [None] * dist.get_world_size()
            dist.all_gather_object(outcomes, (failure, payload))
        failed = [(rank, f) for rank, (f, _) in enumerate(outcomes) if f is not None]
        if not failed:
            return [p for _, p in outcomes]
        written = folder_bytes(self.path)
        if many:
            dist.barrier()  # every rank measured before rank 0 removes
        if not many or dist.get_rank() == 0:
            self._remove_partial()
        if many:
            dist.barrier()
        if any(space for _, (space, _) in failed):
            raise CheckpointSpaceError(space_message(self, written)) from error
        if error is not None:
            raise error
        first, (_, text) = failed[0]
        raise RuntimeError(f"saving {self.path} failed on rank {first}: {text}; the partial save was removed")

    def _remove_partial(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        iteration = os.path.dirname(self.path)
        try:
            os.rmdir(iteration)  # only when no other role saved into it
        except OSError:
            pass


def space_message(target: SaveTarget, written: int) -> str:
    """The one line a full device is reported with."""
    flag, folder = target.save_flag, target.save_dir
    kept = "nothing was saved there before"
    if target.latest is not None:
        kept = f"the latest checkpoint is still iteration {target.latest}, intact (resume with --load {folder})"
    return (
        f"no space left on the device of {flag} {folder} while saving iteration {target.rollout_id} ({written} bytes "
        f"written, about {target.needed} needed: {human(written)} of {human(target.needed)}); removed the partial "
        f"{os.path.relpath(target.path, folder)}, and {kept}. Free space there (older iter_* folders can go) or "
        f"give {flag} a larger disk"
    )
