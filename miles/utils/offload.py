"""Sleep / wake of an actor's device memory (`--colocate-sleep`): the storages of its tensors go to host memory and
their device memory is freed, while every tensor object stays valid (FSDP2's DTensor shards, the optimizer's state,
views and shared storages alike), so nothing that holds a reference has to be rebuilt.

`HostSwap.sleep` copies each distinct storage once into its slice of one host buffer per actor (`HostBuffer`: exactly
the bytes moved, kept for the next cycle while it is large enough; a replaced one is released at once) and resizes it
to 0 bytes; `wake` reallocates it and copies the bytes back, so the values after a wake are the values before the
sleep, bit for bit. On CUDA the buffer is ordinary host memory page-locked with `cudaHostRegister` (as
`torch/cuda/_pin_memory_utils.py` does), not `pin_memory=True`: torch's caching host allocator rounds that up to a
power of two (up to twice the bytes moved) and keeps a freed block cached for the process's life. Storages whose every tensor is in `discard` are freed without a copy: their contents
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


def host_offsets(nbytes: Iterable[int]) -> tuple[list[int], int]:
    """Each storage's offset in the host buffer (its slice starts HOST_ALIGN-aligned) and the buffer's exact size:
    the last slice ends the buffer, unpadded."""
    offsets, end = [], 0
    for size in nbytes:
        start = -(-end // HOST_ALIGN) * HOST_ALIGN
        offsets.append(start)
        end = start + size
    return offsets, end


class CudaHostRegister:
    """Page-locks ordinary host memory in place (`cudaHostRegister`, portable) and unlocks it before it is freed."""

    def pin(self, data_ptr: int, nbytes: int) -> None:
        code = int(torch.cuda.cudart().cudaHostRegister(data_ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
        if code != 0:
            raise RuntimeError(
                f"cudaHostRegister of {nbytes} bytes of host memory failed (cudaError {code}) for --colocate-sleep's "
                "swap buffer: check the locked-memory limit (`ulimit -l`) and free host memory"
            )

    def unpin(self, data_ptr: int) -> None:
        code = int(torch.cuda.cudart().cudaHostUnregister(data_ptr))
        if code != 0:
            raise RuntimeError(f"cudaHostUnregister of the swap buffer failed (cudaError {code})")


class HostBuffer:
    """One host byte buffer of exactly the size asked for, page-locked by `pinner` when one is given (CUDA);
    `release` unlocks and frees it (a buffer is released before a larger one replaces it)."""

    def __init__(self, pinner: CudaHostRegister | None = None) -> None:
        self.pinner = pinner
        self.tensor: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()

    def ensure(self, nbytes: int) -> torch.Tensor:
        """The buffer, replaced by one of exactly `nbytes` when it holds fewer."""
        if self.tensor is None or self.nbytes < nbytes:
            self.release()  # the old buffer goes before the larger one is allocated
            tensor = torch.empty(nbytes, dtype=torch.uint8)
            if self.pinner is not None and nbytes > 0:
                self.pinner.pin(tensor.data_ptr(), nbytes)
            self.tensor = tensor
        return self.tensor

    def release(self) -> None:
        if self.tensor is None:
            return
        if self.pinner is not None and self.nbytes > 0:
            self.pinner.unpin(self.tensor.data_ptr())
        self.tensor = None


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

    def __init__(self, device: torch.device, pinner: CudaHostRegister | None = None) -> None:
        self.device = torch.device(device)
        self.asleep = False
        if pinner is None and self.device.type == "cuda":
            pinner = CudaHostRegister()
        self.buffer = HostBuffer(pinner)  # the one host buffer, reused while it is large enough
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
        storages: dict[int, tuple[torch.UntypedStorage, bool]] = {}  # storage id -> (storage, copy it)
        discard = list(discard)
        discarded = {id(t) for t in discard}  # a tensor given in both lists is discarded
        for tensor, copy in [*((t, False) for t in discard), *((t, True) for t in tensors if id(t) not in discarded)]:
            if tensor is None or not self._on_device(tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            key = storage._cdata  # the storage itself (views share it); not data_ptr: every fake storage's is 0
            previous = storages.get(key)
            storages[key] = (storage, copy or (previous is not None and previous[1]))  # shared: copied if any needs
        pinned = self.device.type == "cuda"
        self._moved = self._plan(storages.values(), report)
        for storage, nbytes, start in self._moved:
            if start is not None:
                self._host_slice(start, nbytes).copy_(_bytes_view(storage), non_blocking=pinned)
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

    @property
    def host(self) -> torch.Tensor | None:
        """The host buffer (None before the first sleep that copies)."""
        return self.buffer.tensor

    def _host_slice(self, start: int, nbytes: int) -> torch.Tensor:
        """One copied storage's bytes in the host buffer (`_plan` sized it before any copy)."""
        if self.host is None:
            raise RuntimeError("HostSwap: a storage to copy but no host buffer (`_plan` sizes it before the copies)")
        return self.host[start : start + nbytes]

    def _plan(
        self, storages: Iterable[tuple[torch.UntypedStorage, bool]], report: SwapReport
    ) -> list[tuple[torch.UntypedStorage, int, int | None]]:
        """(storage, nbytes, host offset or None to discard) of each storage that moves; sizes the host buffer."""
        copied: list[tuple[torch.UntypedStorage, int]] = []
        moved: list[tuple[torch.UntypedStorage, int, int | None]] = []
        for storage, copy in storages:
            nbytes = storage.nbytes()
            if not _resizable(storage):
                report.kept_bytes += nbytes
            elif copy:
                copied.append((storage, nbytes))
                report.copied_bytes += nbytes
            else:
                moved.append((storage, nbytes, None))
                report.discarded_bytes += nbytes
        offsets, total = host_offsets(n for _, n in copied)
        if copied:
            self.buffer.ensure(total)
        return [(s, n, start) for (s, n), start in zip(copied, offsets)] + moved

    def release(self) -> None:
        """Free the host buffer (awake only: asleep it holds the only copy of the moved bytes)."""
        if self.asleep:
            raise RuntimeError("HostSwap.release while asleep would lose the moved storages: wake first")
        self.buffer.release()

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
                _bytes_view(storage).copy_(self._host_slice(start, nbytes), non_blocking=pinned)
                report.copied_bytes += nbytes
        if pinned:
            torch.cuda.synchronize(self.device)  # the host buffers are rewritten by the next sleep
        report.storages = len(self._moved)
        self._moved = []
        self.asleep = False
        report.seconds = time.perf_counter() - started
        return report
