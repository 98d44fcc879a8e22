"""Calls the simulated engine repeats with the same shapes, run once and replayed: on fake tensors a call's memory
and FLOPs are a function of its inputs' shapes alone, so a later call with the same shapes reaches the same height
above what is live when it starts, and returns outputs of the same shapes. A video VAE decode is most of a plan's
time (Wan 2.1: 21 latent frames decoded one at a time, ~3 s each micro-batch under the fake mode, 32 micro-batches
an engine); replayed, an engine's generate call costs one decode. `measure` and `replay` are the record and the
replay of one call, for `ReplayOnce` here and `replay_layers.LayerReplay`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.flop_counter import FlopCounterMode

from miles.plan.tracker import Collective, PlanTracker


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


_SCALARS = (int, float, bool, str, torch.dtype, torch.device, type(None))


class _Unkeyed(Exception):
    """A value a call cannot be keyed on or an output it cannot be made again from: the call runs."""


@dataclass(frozen=True)
class _Recorded:
    rise: int  # the height the call reached above what was live when it started
    flops: float
    output: Any  # `_layout` of the output
    collectives: tuple[Collective, ...] = ()


def _layout(value: Any, as_is: type | tuple[type, ...] = _SCALARS) -> Any:
    """How to make an output like `value` again (`_rebuild`): tensors' layouts, tuples and lists of them,
    dataclasses' fields, values of the types `as_is` as they are; raises `_Unkeyed` otherwise, and for a tensor
    with a graph or a DTensor (its layout is not its shard's)."""
    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value) or value.requires_grad:
            raise _Unkeyed
        return _Layout.of(value)
    if isinstance(value, (tuple, list)):
        return type(value), [_layout(v, as_is) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "dataclass", type(value), {k: _layout(v, as_is) for k, v in _fields(value).items()}
    if isinstance(value, as_is):
        return "as is", value
    raise _Unkeyed


def _rebuild(layout: Any) -> Any:
    if isinstance(layout, _Layout):
        return layout.make()
    if layout[0] == "as is":
        return layout[1]
    if layout[0] == "dataclass":
        return layout[1](**{k: _rebuild(v) for k, v in layout[2].items()})
    kind, items = layout
    return kind(_rebuild(v) for v in items)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for v in _fields(value).values() for t in _tensors(v)]
    return []


def _fields(value: Any) -> dict[str, Any]:
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}


def measure(
    tracker: PlanTracker,
    ledger: Ledger | None,
    run: Callable[[], Any],
    inputs: Any,
    as_is: type | tuple[type, ...] = _SCALARS,
) -> tuple[Any, _Recorded | None]:
    """Run a call, and what replaying it takes (`replay`) when it kept nothing but new outputs: outputs that share
    no storage with each other or with `inputs` (None otherwise, or when `_layout` cannot make them again)."""
    start, issued = tracker.live_bytes, len(tracker.collectives)
    flops_before = ledger.total() if ledger is not None else 0.0
    with tracker.rise() as rise:
        out = run()
    tracker.recount()
    tensors = _tensors(out)
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    fresh = len(storages) == len(tensors) and not storages.keys() & {id(t.untyped_storage()) for t in _tensors(inputs)}
    if not fresh or tracker.live_bytes != start + sum(storages.values()):
        return out, None
    try:
        layout = _layout(out, as_is)
    except _Unkeyed:
        return out, None
    flops = ledger.total() - flops_before if ledger is not None else 0.0
    return out, _Recorded(rise[0], flops, layout, tuple(tracker.collectives[issued:]))


def replay(tracker: PlanTracker, ledger: Ledger | None, recorded: _Recorded) -> Any:
    """A recorded call again: the tracker counts its height above what is live now and its collectives, the ledger
    its FLOPs; its outputs are new tensors of the recorded layouts (uninitialised, as every fake tensor is)."""
    if ledger is not None:
        ledger.replayed_flops += recorded.flops
    tracker.reach(tracker.live_bytes + recorded.rise)
    tracker.collectives.extend(recorded.collectives)
    return _rebuild(recorded.output)


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
    replayed (`replay`); its output's fields that are not tensors (of any type) are given again as they are. A call
    with other arguments (a causal decoder's cache) always runs, and an output with a graph is never recorded (an
    engine decodes without gradient)."""

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
            return replay(self.tracker, self.ledger, found)
        self.runs += 1
        out, recorded = measure(self.tracker, self.ledger, lambda: self.method(x), x, as_is=object)
        if recorded is not None:  # an output with a graph is not (the graph would keep its inputs alive)
            self.recorded[key] = recorded
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
