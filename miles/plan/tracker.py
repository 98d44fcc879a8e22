"""What one simulated rank does, seen from torch's dispatcher: the bytes of its live storages (current, and the peak
of each named phase) and the collectives it issues (op, group size, dtype, element count), in order."""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
# `tensor.device` read from C++ on a fake tensor: about half the ops a simulation dispatches, none of them making a
# storage or a collective; answered without the tracker's bookkeeping
_PRIM_DEVICE = torch.ops.prim.device.default


@dataclass(frozen=True)
class Collective:
    """One collective as every rank of its group must issue it alike."""

    op: str
    group_size: int
    dtype: str
    numel: int
    phase: str

    def describe(self) -> str:
        return f"{self.op} over {self.group_size} ranks, {self.numel} x {self.dtype} ({self.phase})"


class PlanTracker(TorchDispatchMode):
    """Counts the bytes of every storage an op creates until the storage dies (`live_bytes`), the largest count of
    each phase (`peaks`), and records the collectives. Enter it inside the fake mode, so it sees ops first.

    Storages resized in place outside the dispatcher (FSDP2 frees and reallocates its gathered parameters this way;
    sleep / wake too) are followed while the tracker is entered: `UntypedStorage.resize_` reports to it."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self.live_bytes = 0
        self.phase = "start-up"
        self.peaks: dict[str, int] = {}
        self.after: dict[str, int] = {}  # live bytes when each phase ended
        self.collectives: list[Collective] = []

    # ---- memory ------------------------------------------------------------------------------
    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._sizes and self._refs[key]() is storage:
            return
        self._sizes[key] = storage.nbytes()
        self._refs[key] = weakref.ref(storage, functools.partial(self._collected, key))
        self.live_bytes += self._sizes[key]
        self._note_peak()

    def _collected(self, key: int, _: object) -> None:
        """The weak reference's callback: the storage of `key` died."""
        self._free(key)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _note_peak(self) -> None:
        if self.live_bytes > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = self.live_bytes

    def adopt(self, tensors: list[torch.Tensor]) -> None:
        """Count tensors made outside the tracker (before it was entered)."""
        for tensor in tensors:
            self._track_inner(tensor)

    def recount(self) -> None:
        """Re-read every live storage's size (after storages were resized to free or restore them)."""
        gc.disable()  # a collection here would run weakref callbacks that resize the dict being copied
        try:
            refs = list(self._refs.items())
        finally:
            gc.enable()
        for key, ref in refs:
            storage = ref()
            if storage is None:
                continue
            self.live_bytes += storage.nbytes() - self._sizes[key]
            self._sizes[key] = storage.nbytes()
        self._note_peak()

    @contextlib.contextmanager
    def in_phase(self, name: str) -> Iterator[None]:
        """Attribute the peak of what runs inside to phase `name` (starting from what is live now)."""
        previous, self.phase = self.phase, name
        self.peaks[name] = max(self.peaks.get(name, 0), self.live_bytes)
        try:
            yield
        finally:
            self.recount()
            self.after[name] = self.live_bytes
            self.phase = previous

    @contextlib.contextmanager
    def rise(self) -> Iterator[list[int]]:
        """Measures what runs inside: yields a list that holds, on exit, the largest live count reached inside minus
        the count at entry (the phase's peak still counts it)."""
        start, kept = self.live_bytes, self.peaks.get(self.phase, 0)
        self.peaks[self.phase] = start
        measured: list[int] = []
        try:
            yield measured
        finally:
            measured.append(self.peaks[self.phase] - start)
            self.peaks[self.phase] = max(kept, self.peaks[self.phase])

    def reach(self, live_bytes: int) -> None:
        """Count a moment at which `live_bytes` were live in the current phase (a replayed call's peak)."""
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), live_bytes)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes and self._refs[key]() is storage:
            self.live_bytes += storage.nbytes() - self._sizes[key]
            self._sizes[key] = storage.nbytes()
            self._note_peak()
        elif storage.device.type != "meta":
            self._track(torch.empty(0, device=storage.device).set_(storage))

    def __enter__(self) -> PlanTracker:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            out = original(storage, size)
            tracker._resized(storage)
            return out

        self._resize_patch = mock.patch.object(torch.UntypedStorage, "resize_", resize_)
        self._resize_patch.start()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._resize_patch.stop()
        return super().__exit__(*exc)

    # ---- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _PRIM_DEVICE:
            return func(*args)
        out = func(*args, **(kwargs or {}))
        namespace = func.namespace if hasattr(func, "namespace") else ""
        if namespace in _COLLECTIVE_NAMESPACES:
            self._record_collective(func, args)
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track_inner(value)
        return out

    def _track_inner(self, value: torch.Tensor) -> None:
        """A plain tensor's storage; a wrapper subclass's (a DTensor: its local shard) inner tensors instead, whose
        ops ran below this mode: the wrapper's own storage stands for the global size, which no rank holds."""
        if is_traceable_wrapper_subclass(value):
            names, _ = value.__tensor_flatten__()
            for name in names:
                inner = getattr(value, name)
                if isinstance(inner, torch.Tensor):
                    self._track_inner(inner)
        elif value.device.type != "meta":
            self._track(value)

    def _record_collective(self, func: Any, args: Any) -> None:
        values = tree_flatten(args)[0]
        tensors = [t for t in values if isinstance(t, torch.Tensor)]
        groups = [v.size() for v in values if isinstance(v, dist.ProcessGroup)]
        if not groups:  # a functional collective: (input, group_size, group_name)
            groups = [v for v in values if isinstance(v, int) and not isinstance(v, bool)][:1]
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "-"
        name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
        numel = sum(t.numel() for t in tensors)
        self.collectives.append(Collective(name, int(groups[0]) if groups else 0, dtype, numel, self.phase))
