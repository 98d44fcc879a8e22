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
        elements = self.storage_bytes // self.dtype.itemsize
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
class Ledger:
    """FLOPs of replayed calls, which no FLOP counter sees (shared by nested replays: a replayed decode counts the
    replayed tiles its first run held)."""

    flops: FlopCounterMode
    replayed_flops: float = 0.0

    def total(self) -> float:
        return float(self.flops.get_total_flops()) + self.replayed_flops


@dataclass
class ReplayOnce:
    """Stands in for a method of one tensor argument on fake tensors (a family's `decode_latents`, a VAE's tile
    decoder): a call runs unless an earlier call with the same input layout kept nothing but its output (a first
    call may load what later ones reuse, e.g. a VAE held after first use: the next one runs too); such a call is
    replayed: the tracker counts the recorded height above what is live now, the ledger the recorded FLOPs, and the
    output is a new tensor of each recorded layout (uninitialised, as every fake tensor is). A call with other
    arguments (a causal decoder's cache) always runs, and an output with a graph is never recorded (an engine decodes
    without gradient)."""

    method: Callable[..., Any]
    tracker: PlanTracker
    ledger: Ledger
    recorded: dict[tuple[Any, ...], _Recorded] = field(default_factory=dict)
    runs: int = 0
    replays: int = 0

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self.method(x, *args, **kwargs)
        key = (tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device))
        found = self.recorded.get(key)
        if found is not None:
            self.replays += 1
            self.ledger.replayed_flops += found.flops
            self.tracker.reach(self.tracker.live_bytes + found.rise)
            return _rebuild(found.output)
        self.runs += 1
        start, flops_before = self.tracker.live_bytes, self.ledger.total()
        with self.tracker.rise() as rise:
            out = self.method(x)
        self.tracker.recount()
        tensors = _tensors(out)
        kept_nothing = self.tracker.live_bytes == start + _storage_bytes(tensors)
        if kept_nothing and not any(t.requires_grad for t in tensors):  # a graph would keep its inputs alive
            self.recorded[key] = _Recorded(rise[0], self.ledger.total() - flops_before, _layout(out))
        return out


def replay_decodes(family: Any, tracker: PlanTracker, ledger: Ledger) -> list[ReplayOnce]:
    """Replay `family.decode_latents` and, inside it, each loaded VAE's `decoder` (a tiled decode calls it per tile:
    tiles of one shape decode alike)."""
    replays = [ReplayOnce(family.decode_latents, tracker, ledger)]
    family.decode_latents = replays[0]
    for module in family.loaded_modules():
        decoder = getattr(module, "decoder", None)
        if isinstance(decoder, torch.nn.Module):
            replays.append(ReplayOnce(decoder.forward, tracker, ledger))
            decoder.forward = replays[-1]
    return replays
