"""Calls the simulated engine repeats with the same shapes, run once and replayed: on fake tensors a call's memory
and FLOPs are a function of its inputs' shapes alone, so a later call with the same shapes reaches the same height
above what is live when it starts, and returns outputs of the same shapes. A video VAE decode is most of a plan's
time (Wan 2.1: 21 latent frames decoded one at a time, ~3 s each micro-batch under the fake mode, 32 micro-batches
an engine); replayed, an engine's generate call costs one decode."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from miles.plan.tracker import PlanTracker


@dataclass(frozen=True)
class _Layout:
    """How to make a tensor like one an earlier call returned: the same shape, strides and storage size."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    storage_bytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Layout:
        size, stride = tuple(int(n) for n in tensor.shape), tuple(int(n) for n in tensor.stride())
        offset, nbytes = int(tensor.storage_offset()), int(tensor.untyped_storage().nbytes())
        return cls(size, stride, offset, tensor.dtype, tensor.device, nbytes)

    def make(self) -> torch.Tensor:
        elements = self.storage_bytes // torch.empty((), dtype=self.dtype).element_size()
        flat = torch.empty(elements, dtype=self.dtype, device=self.device)
        return flat.as_strided(self.size, self.stride, self.offset)


@dataclass(frozen=True)
class _Recorded:
    rise: int  # the height the call reached above what was live when it started
    flops: float
    output: Any  # `_layout` of the output


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in _fields(value).values() if isinstance(v, torch.Tensor)]


def _fields(value: Any) -> dict[str, Any]:
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"a replayed call returns a tensor or a dataclass of tensors, not {type(value).__name__}")
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}


def _layout(value: Any) -> Any:
    """What `_rebuild` makes a new output like `value` from (its tensors' layouts, its other fields as they are)."""
    if isinstance(value, torch.Tensor):
        return _Layout.of(value)
    fields = {k: _Layout.of(v) if isinstance(v, torch.Tensor) else v for k, v in _fields(value).items()}
    return type(value), fields


def _rebuild(layout: Any) -> Any:
    if isinstance(layout, _Layout):
        return layout.make()
    kind, fields = layout
    return kind(**{k: v.make() if isinstance(v, _Layout) else v for k, v in fields.items()})


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@dataclass
class ReplayOnce:
    """Stands in for a method of one tensor argument on fake tensors (a family's `decode_latents`): a call runs
    unless an earlier call with the same input shape kept nothing but its output (a first call may load what later
    ones reuse, e.g. a VAE held after first use: the next one runs too); such a call is replayed: the tracker counts
    the recorded height above what is live now, the FLOP counter the recorded FLOPs, and the output is a new tensor
    of each recorded layout (uninitialised, as every fake tensor is)."""

    method: Callable[[torch.Tensor], Any]
    tracker: PlanTracker
    flops: FlopCounterMode
    recorded: dict[tuple[Any, ...], _Recorded] = field(default_factory=dict)
    runs: int = 0
    replays: int = 0
    replayed_flops: float = 0.0

    def __call__(self, x: torch.Tensor) -> Any:
        key = (tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device))
        found = self.recorded.get(key)
        if found is not None:
            self.replays += 1
            self.replayed_flops += found.flops
            self.tracker.reach(self.tracker.live_bytes + found.rise)
            return _rebuild(found.output)
        self.runs += 1
        start, flops_before = self.tracker.live_bytes, self.flops.get_total_flops()
        with self.tracker.rise() as rise:
            out = self.method(x)
        self.tracker.recount()
        if self.tracker.live_bytes == start + _storage_bytes(_tensors(out)):  # kept nothing else: replayable
            flops = float(self.flops.get_total_flops() - flops_before)
            self.recorded[key] = _Recorded(rise[0], flops, _layout(out))
        return out
