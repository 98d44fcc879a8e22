"""Repeated layers run without gradients, run once per input layout and replayed (`replay` replays whole decodes):
a transformer's blocks, a text encoder's layers and a VAE's resnets are lists of layers of one kind, and without
gradients a layer's memory, FLOPs and collectives on fake tensors follow from its class, its parameters' and its
inputs' layouts alone. An engine's forward, its text encoding and each trainer rank's no-gradient forwards (the old
policy's, a teacher's) then run one layer of each kind and replay the others. Under FSDP2 the replayed forward is the
inner one: the hooks around it (the gathers, the reshards, FSDP2's forward order) run as they do, and a layer that
holds sharded children is not replayed itself, its children are."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from miles.plan.replay import _SCALARS, Ledger, _Recorded, _Unkeyed, measure, replay
from miles.plan.tracker import PlanTracker


def _key(value: Any) -> Any:
    """What a layer's call depends on, of one argument: a plain tensor's layout, a tuple's items, a scalar itself;
    raises `_Unkeyed` for anything else (a list or dict may be a cache the layer writes into; a DTensor's layout is
    not its shard's)."""
    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            raise _Unkeyed
        shape, stride = tuple(value.shape), tuple(value.stride())
        return ("tensor", shape, stride, value.dtype, str(value.device), value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_key(v) for v in value)
    if isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    raise _Unkeyed


@dataclass
class LayerReplay:
    """The repeated layers of one simulated process (`replay_layers`), and what their calls recorded: a call
    without gradients runs when no earlier one had the same layer class, parameters, inputs and phase, or when
    it kept anything but its outputs (or its outputs share storage with its inputs or each other); otherwise it is
    replayed: the tracker counts the recorded height above what is live now and the recorded collectives, the
    ledger the recorded FLOPs, and the outputs are new tensors of the recorded layouts. A call with gradients
    always runs (its graph keeps its inputs)."""

    tracker: PlanTracker
    ledger: Ledger | None  # None where nothing reads the FLOPs (a trainer rank's come from its passes)
    recorded: dict[Any, _Recorded] = field(default_factory=dict)
    unreplayable: dict[Any, int] = field(default_factory=dict)  # calls measured that kept something, per key
    wrapped: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)
    runs: int = 0
    replays: int = 0

    def wrap(self, module: nn.Module) -> None:
        """Replace `module`'s forward by one that replays (once per module)."""
        if module in self.wrapped:
            return
        self.wrapped.add(module)
        module.forward = _replayed_forward(self, module)

    def call(self, module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if torch.is_grad_enabled():
            return forward(*args, **kwargs)
        try:
            key = (_module_key(module), _key(args), _key(tuple(sorted(kwargs.items()))), self.tracker.phase)
        except _Unkeyed:
            return forward(*args, **kwargs)
        if self.unreplayable.get(key, 0) >= 2:  # kept something twice (a first call may load what later ones use)
            return forward(*args, **kwargs)
        found = self.recorded.get(key)
        if found is not None:
            self.replays += 1
            return replay(self.tracker, self.ledger, found)
        self.runs += 1
        out, recorded = measure(
            self.tracker, self.ledger, lambda: forward(*args, **kwargs), (args, tuple(kwargs.values()))
        )
        if recorded is None:
            self.unreplayable[key] = self.unreplayable.get(key, 0) + 1
        else:
            self.recorded[key] = recorded
        return out


def _replayed_forward(layers: LayerReplay, module: nn.Module) -> Callable[..., Any]:
    """`module.forward` through `layers`, holding the module weakly: a freed text encoder's layers (the engine frees
    it after the prompt-cache fill) are not kept alive by their own forwards."""
    forward, ref = module.forward, weakref.ref(module)
    method = getattr(forward, "__func__", None) if getattr(forward, "__self__", None) is module else None
    if method is not None:
        del forward  # the bound method would hold the module

    def replayed(*args: Any, **kwargs: Any) -> Any:
        layer = ref()
        assert layer is not None, "a freed module's forward was called"
        return layers.call(layer, forward if method is None else method.__get__(layer), args, kwargs)

    return replayed


def _module_key(module: nn.Module) -> tuple:
    params = tuple(
        (name, tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    )
    return type(module), module.training, params


def repeated_layers(root: nn.Module) -> list[nn.Module]:
    """The layers of `root`'s module lists of two or more layers of one class (a transformer's blocks, an encoder's
    layers, a VAE's resnets), each the largest module that holds no FSDP2-sharded module below itself (a block split
    into sharded children gives its children)."""
    from torch.distributed.fsdp import FSDPModule

    layers: list[nn.Module] = []

    def largest_unsharded(module: nn.Module) -> Iterable[nn.Module]:
        if not any(isinstance(m, FSDPModule) for m in module.modules() if m is not module):
            yield module
            return
        for child in module.children():
            yield from largest_unsharded(child)

    for module in root.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            for layer in module:
                layers.extend(largest_unsharded(layer))
    return list({id(m): m for m in layers}.values())


def replay_layers(replay: LayerReplay, modules: Iterable[nn.Module]) -> int:
    """Wrap the repeated layers of `modules` (`repeated_layers`); returns how many."""
    layers = [layer for module in modules for layer in repeated_layers(module)]
    for layer in layers:
        replay.wrap(layer)
    return len(layers)
