"""Sleep / wake of an actor's device memory (`--colocate-sleep`): the storages of its tensors go to host memory and
their device memory is freed, while every tensor object stays valid (FSDP2's DTensor shards, the optimizer's state,
views and shared storages alike), so nothing that holds a reference has to be rebuilt.

`HostSwap.sleep` copies each distinct storage once into its slice of one host buffer per actor (pinned on CUDA, kept
for the next cycle; one buffer because the pinned allocator rounds every allocation up to a power of two, which
for one buffer per storage could cost up to twice the host memory moved) and resizes it to 0 bytes; `wake` reallocates it and copies the bytes back, so the values after a wake are the values
before the sleep, bit for bit. Storages whose every tensor is in `discard` are freed without a copy: their contents
are about to be replaced (an engine's trained weights, which the next weight sync overwrites); after a wake they hold
garbage until then.

Only storages on `device` move (with `--fsdp-cpu-offload` the shards already live on the host). On a CPU device the
same steps run (host buffers in the same RAM): nothing is saved there, but the sequence is the one CUDA runs, which
is how it is tested on machines without a GPU. A storage that cannot be resized (memory-mapped from a file) stays
where it is and is counted in `kept_bytes`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

HOST_ALIGN = 512  # bytes: each storage's slice of the host buffer starts aligned, for full-speed copies


@dataclass
class SwapReport:
    """What one `sleep` or `wake` did: bytes copied to / from the host, bytes freed without a copy (sleep) or
    reallocated empty (wake), bytes left in place, storages moved, and seconds."""

    copied_bytes: int = 0
    discarded_bytes: int = 0
    kept_bytes: int = 0
    storages: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        gib = 2**30
        return (
            f"{self.copied_bytes / gib:.3f} GiB copied, {self.discarded_bytes / gib:.3f} GiB without a copy, "
            f"{self.kept_bytes / gib:.3f} GiB left in place, {self.storages} storages, {self.seconds:.2f}s"
        )


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _resizable(storage: torch.UntypedStorage) -> bool:
    try:
        return bool(storage.resizable())
    except (AttributeError, RuntimeError):  # older storages: assume the allocator's
        return True


class HostSwap:
    """Moves the storages of the tensors given to `sleep` to host memory and back (`wake`); see the module doc."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.asleep = False
        self.host: torch.Tensor | None = None  # the one host buffer, reused while it is large enough
        self._moved: list[tuple[torch.UntypedStorage, int, int | None]] = []  # (storage, nbytes, offset or None)

    def _on_device(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != self.device.type:
            return False
        return self.device.index is None or tensor.device.index == self.device.index

    def sleep(self, tensors: Iterable[torch.Tensor], discard: Iterable[torch.Tensor] = ()) -> SwapReport:
        """Free the device memory of `tensors` (and of `discard`, which is not copied); idempotent while asleep."""
        if self.asleep:
            return SwapReport()
        started = time.perf_counter()
        report = SwapReport()
        storages: dict[int, tuple[torch.UntypedStorage, bool]] = {}  # data_ptr -> (storage, copy it)
        discard = list(discard)
        discarded = {id(t) for t in discard}  # a tensor given in both lists is discarded
        for tensor, copy in [*((t, False) for t in discard), *((t, True) for t in tensors if id(t) not in discarded)]:
            if tensor is None or not self._on_device(tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            key = storage.data_ptr()
            previous = storages.get(key)
            storages[key] = (storage, copy or (previous is not None and previous[1]))  # shared: copied if any needs
        self._moved = []
        pinned = self.device.type == "cuda"
        offset = 0
        for storage, copy in storages.values():
            nbytes = storage.nbytes()
            if not _resizable(storage):
                report.kept_bytes += nbytes
                continue
            if copy:
                self._moved.append((storage, nbytes, offset))
                offset += -(-nbytes // HOST_ALIGN) * HOST_ALIGN
                report.copied_bytes += nbytes
            else:
                self._moved.append((storage, nbytes, None))
                report.discarded_bytes += nbytes
        if self.host is None or self.host.numel() < offset:
            self.host = None  # the old buffer goes before the larger one is allocated
            self.host = torch.empty(offset, dtype=torch.uint8, pin_memory=pinned)
        for storage, nbytes, start in self._moved:
            if start is not None:
                self.host[start : start + nbytes].copy_(_bytes_view(storage), non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize(self.device)  # the copies are done before their source is freed
        for storage, _, _ in self._moved:
            storage.resize_(0)
        if pinned:
            torch.cuda.empty_cache()  # give the freed blocks back, for the other phase's process
        report.storages = len(self._moved)
        report.seconds = time.perf_counter() - started
        self.asleep = True
        return report

    def wake(self) -> SwapReport:
        """Reallocate every storage `sleep` freed and copy its bytes back (discarded ones stay uninitialised)."""
        if not self.asleep:
            return SwapReport()
        started = time.perf_counter()
        report = SwapReport()
        pinned = self.device.type == "cuda"
        for storage, nbytes, start in self._moved:
            storage.resize_(nbytes)
            if start is None:
                report.discarded_bytes += nbytes
            else:
                _bytes_view(storage).copy_(self.host[start : start + nbytes], non_blocking=pinned)
                report.copied_bytes += nbytes
        if pinned:
            torch.cuda.synchronize(self.device)  # the host buffers are rewritten by the next sleep
        report.storages = len(self._moved)
        self._moved = []
        self.asleep = False
        report.seconds = time.perf_counter() - started
        return report
