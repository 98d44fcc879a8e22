"""A call the simulated engine repeats with the same shapes runs once and is replayed (miles/plan/replay.py): the
phase's peak, what stays live and the FLOPs are those of running every call, a call that keeps state runs again, and
a replayed output has the recorded layout."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.flop_counter import FlopCounterMode

from miles.models.media import Media
from miles.plan.fake import plan_tensor_mode
from miles.plan.replay import Ledger, ReplayOnce, replay_decodes
from miles.plan.tracker import PlanTracker


class Decoder:
    """A decode that builds temporaries larger than its output, and a cache on its first call (as a VAE loaded on
    first use)."""

    def __init__(self) -> None:
        self.cache: torch.Tensor | None = None
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> Media:
        self.calls += 1
        if self.cache is None:
            self.cache = torch.zeros(64, 64)
        wide = torch.cat([x, x, x, x], dim=1) @ torch.ones(4 * x.shape[1], 8)  # a temporary 4x the input
        frames = (wide.sigmoid() + self.cache.sum()).reshape(x.shape[0], 2, 1, 2, 2)  # (B, F, 1, H, W)
        return Media(frames.expand(-1, -1, 3, -1, -1).contiguous(), fps=8.0)


def run_calls(replay: bool, shapes: list[tuple[int, int]]) -> tuple[dict, int, float, list, int]:
    decoder = Decoder()
    with plan_tensor_mode(True), PlanTracker() as tracker, FlopCounterMode(display=False) as flops:
        ledger = Ledger(flops)
        decode = ReplayOnce(decoder, tracker, ledger) if replay else decoder
        kept, outputs = [], []
        with tracker.in_phase("generate"):
            for shape in shapes:
                media = decode(torch.empty(shape))
                kept.append(torch.empty(shape[0], 16))  # results accumulate between calls, as an engine's do
                outputs.append((tuple(media.pixels.shape), media.pixels.stride(), media.pixels.dtype, media.fps))
                del media
        return dict(tracker.peaks), tracker.live_bytes, ledger.total(), outputs, decoder.calls


def test_replayed_calls_reach_the_peaks_and_flops_of_running_every_call():
    shapes = [(32, 40), (32, 40), (32, 40), (16, 40), (32, 40), (16, 40), (16, 40)]
    ran = run_calls(False, shapes)
    replayed = run_calls(True, shapes)
    assert replayed[:4] == ran[:4]
    # the first call keeps the cache (runs again), then one run per new shape: 3 of the 7 calls ran
    assert (ran[4], replayed[4]) == (7, 3)


def test_a_replayed_output_has_the_recorded_layout_and_storage():
    """An output that views part of a larger storage is made again with that storage size, offset and strides."""
    with plan_tensor_mode(True), PlanTracker() as tracker, FlopCounterMode(display=False) as flops:
        decode = ReplayOnce(lambda x: (x.new_empty(4, 6, 5) + 1).permute(2, 0, 1)[1:], tracker, Ledger(flops))
        first = decode(torch.empty(3))
        live = tracker.live_bytes
        second = decode(torch.empty(3))
        assert decode.replays == 1 and tracker.live_bytes == live + 480
        assert (second.shape, second.stride(), second.storage_offset()) == (
            first.shape,
            first.stride(),
            first.storage_offset(),
        )
        assert second.untyped_storage().nbytes() == first.untyped_storage().nbytes() == 480


class TiledFamily:
    """A family whose VAE decodes in tiles (as HunyuanVideo 1.5's tiled decode): its `decoder` runs once per tile,
    the last tile shorter; the tiles stay live until joined."""

    def __init__(self) -> None:
        self.vae = torch.nn.Module()
        self.vae.decoder = torch.nn.Linear(8, 24)

    def loaded_modules(self) -> list[torch.nn.Module]:
        return [self.vae]

    def decode_latents(self, x: torch.Tensor) -> torch.Tensor:
        tiles = [self.vae.decoder(x[start : start + 4]) for start in range(0, x.shape[0], 4)]
        return torch.cat(tiles).relu()


def run_tiled(replay: bool) -> tuple[dict, int, float, int]:
    family = TiledFamily()
    with plan_tensor_mode(True), PlanTracker() as tracker, FlopCounterMode(display=False) as flops:
        ledger = Ledger(flops)
        replays = replay_decodes(family, tracker, ledger) if replay else []
        with tracker.in_phase("generate"), torch.no_grad():  # as the engine decodes
            kept = [family.decode_latents(torch.empty(18, 8)) for _ in range(3)]  # tiles of 4, 4, 4, 4 and 2
        runs = sum(r.runs for r in replays)
        return dict(tracker.peaks), tracker.live_bytes - sum(t.numel() * 4 for t in kept), ledger.total(), runs


def test_nested_replays_of_a_tiled_decode_count_what_running_it_all_counts():
    ran, replayed = run_tiled(False), run_tiled(True)
    assert replayed[:3] == ran[:3]
    assert replayed[3] == 1 + 2  # the first decode ran (its first 4-wide and its 2-wide tile ran, the others replayed)


def test_a_replayed_output_keeps_its_fields_that_are_not_tensors_and_refuses_a_graph():
    """A decode's output may carry any other field (a dict of settings here): given again as it is. An output with a
    graph keeps its inputs alive: that call is never recorded, so it runs every time."""

    @dataclasses.dataclass
    class Decoded:
        pixels: torch.Tensor
        settings: dict

    settings = {"fps": 8.0, "names": ["a"]}
    with plan_tensor_mode(True), PlanTracker() as tracker, FlopCounterMode(display=False) as flops:
        decode = ReplayOnce(lambda x: Decoded(x * 2, settings), tracker, Ledger(flops))
        first, second = decode(torch.empty(3)), decode(torch.empty(3))
        assert (decode.runs, decode.replays) == (1, 1) and second.settings is settings
        assert second.pixels.shape == first.pixels.shape and second.pixels is not first.pixels
        graph = ReplayOnce(lambda x: x * 2, tracker, Ledger(flops))
        weights = torch.empty(3, requires_grad=True)
        graph(weights), graph(weights)
        assert (graph.runs, graph.replays) == (2, 0)
