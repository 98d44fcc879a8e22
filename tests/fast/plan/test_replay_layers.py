"""Repeated layers without gradients run once per layout and are replayed (miles/plan/replay_layers.py): the peaks,
what stays live, the FLOPs and the collectives are those of running every layer; a layer that keeps state, a call
with gradients and a list of unlike layers run every time."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from miles.plan.fake import fake_process_group, plan_tensor_mode
from miles.plan.replay import Ledger
from miles.plan.replay_layers import LayerReplay, repeated_layers, replay_layers
from miles.plan.tracker import PlanTracker


class Block(nn.Module):
    """A layer whose temporaries are larger than its output, returning a tuple (as diffusers' blocks do), with a
    collective inside (as a sequence-parallel attention's)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0, *, context: tuple | None = None) -> tuple:
        wide = self.up(x).relu() * scale
        dist.all_reduce(wide)
        return self.down(wide) + x, (context[0] * 2,) if context else None


class CachingBlock(Block):
    """A layer that keeps a tensor on each call (a cache): never replayed."""

    def forward(self, x: torch.Tensor, scale: float = 1.0, *, context: tuple | None = None) -> tuple:
        self.kept = [*getattr(self, "kept", []), x.new_empty(16)]
        return super().forward(x, scale, context=context)


class Model(nn.Module):
    def __init__(self, caching: bool = False) -> None:
        super().__init__()
        kind = CachingBlock if caching else Block
        self.blocks = nn.ModuleList([kind() for _ in range(4)])
        self.unlike = nn.ModuleList([nn.Linear(8, 8), nn.GELU()])  # two classes: not repeated layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = (x[:, :2].clone(),)
        for block in self.blocks:
            x, context = block(x, 0.5, context=context)
        return self.unlike[1](self.unlike[0](x))


def run(replay: bool, caching: bool = False, grad: bool = False) -> tuple:
    with fake_process_group(0, 2), plan_tensor_mode(True), PlanTracker() as tracker:
        model = Model(caching)  # its parameters counted, as the planner builds its models
        with FlopCounterMode(display=False) as flops:
            ledger = Ledger(flops)
            layers = LayerReplay(tracker, ledger)
            if replay:
                assert replay_layers(layers, [model]) == 4
            with tracker.in_phase("generate"), torch.set_grad_enabled(grad):
                outputs = [model(torch.empty(3, 8)) for _ in range(2)]
                kept = [tuple(o.shape) for o in outputs]
            collectives = [(c.op, c.numel, c.phase) for c in tracker.collectives]
            return dict(tracker.peaks), tracker.live_bytes, ledger.total(), collectives, kept, layers.replays


def test_replayed_layers_count_what_running_every_layer_counts():
    ran, replayed = run(False), run(True)
    assert replayed[:5] == ran[:5]
    assert len(ran[3]) == 8 and ran[2] > 0
    assert replayed[5] == 7  # one block ran, seven were replayed


def test_layers_that_keep_state_or_build_a_graph_run():
    assert run(True, caching=True)[:5] == run(False, caching=True)[:5]
    assert run(True, caching=True)[5] == 0 and run(True, grad=True)[5] == 0


def test_only_lists_of_one_class_are_repeated_layers():
    model = Model()
    assert repeated_layers(model) == list(model.blocks)


def test_a_wrapped_layer_is_freed_with_its_model():
    """The engine frees its text encoder after the prompt-cache fill: wrapped layers must not keep it alive."""
    import gc
    import weakref

    model, layers = Model(), LayerReplay(PlanTracker(), Ledger(FlopCounterMode(display=False)))
    replay_layers(layers, [model])  # `layers` lives on, as the engine's does while it generates
    freed = weakref.ref(model.blocks[0])
    del model
    gc.collect()
    assert freed() is None and len(layers.wrapped) == 0
