"""The micro-batch prefetcher in process: same prepare calls in the same order, and n+1 prepared during n."""

from __future__ import annotations

import argparse
import threading

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub.types import PreparedBatch
from miles.backends.fsdp_utils.microbatch import MicroBatch
from miles.backends.fsdp_utils.prefetch import MicrobatchPrefetcher, prefetch_enabled, tensors_in
from miles.models.conditioning import Conditioning

PAIRS = {"x": torch.arange(8.0)}
WINDOW = [MicroBatch(start=2 * i, end=2 * i + 2, microbatch_id=10 + i) for i in range(4)]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool, str]] = []
        self.pads: list = []
        self.started = {mb.microbatch_id: threading.Event() for mb in WINDOW}

    def __call__(self, ctx, batch, *, microbatch_id, optim_step_idx, pad_to_len):  # no default: passed explicitly
        self.pads.append(pad_to_len)
        self.calls.append((microbatch_id, optim_step_idx, torch.is_grad_enabled(), threading.current_thread().name))
        self.started[microbatch_id].set()
        return PreparedBatch(latents=batch["x"] * 2, sigmas=batch["x"], embeds=None)


@pytest.mark.parametrize("grad", [True, False])
def test_prefetch_prepares_the_next_microbatch_while_the_caller_holds_this_one(grad):
    recorder, prefetcher = Recorder(), MicrobatchPrefetcher(True, torch.device("cpu"))
    got = []
    try:
        with torch.set_grad_enabled(grad):
            for index, (mb, batch, prepared) in enumerate(prefetcher.prepared(recorder, None, PAIRS, WINDOW, 3)):
                if index + 1 < len(WINDOW):  # n+1's prepare starts while n is held here
                    assert recorder.started[WINDOW[index + 1].microbatch_id].wait(timeout=30)
                got.append((mb.microbatch_id, batch["x"].tolist(), prepared.latents.tolist()))
    finally:
        prefetcher.shutdown()
    assert [c[:3] for c in recorder.calls] == [(10 + i, 3, grad) for i in range(4)]
    assert all(name.startswith("miles-prefetch") for *_, name in recorder.calls)
    plain = Recorder()
    with torch.set_grad_enabled(grad):
        expected = [
            (mb.microbatch_id, batch["x"].tolist(), prepared.latents.tolist())
            for mb, batch, prepared in MicrobatchPrefetcher(False, torch.device("cpu")).prepared(
                plain, None, PAIRS, WINDOW, 3
            )
        ]
    assert got == expected
    assert [c[:3] for c in plain.calls] == [c[:3] for c in recorder.calls]
    assert all(name == threading.current_thread().name for *_, name in plain.calls)
    assert recorder.pads == plain.pads == [None] * len(WINDOW)  # the contract's third keyword, from both paths


def test_an_error_in_a_prefetched_prepare_reaches_the_caller():
    def prepare(ctx, batch, *, microbatch_id, optim_step_idx, pad_to_len=None):
        if microbatch_id == 12:
            raise ValueError("bad micro-batch 12")
        return PreparedBatch(latents=batch["x"], sigmas=batch["x"], embeds=None)

    prefetcher = MicrobatchPrefetcher(True, torch.device("cpu"))
    try:
        with pytest.raises(ValueError, match="bad micro-batch 12"):
            list(prefetcher.prepared(prepare, None, PAIRS, WINDOW, 0))
    finally:
        prefetcher.shutdown()


def test_auto_prefetches_on_cuda_only():
    args = argparse.Namespace(prefetch_microbatches="auto")
    assert prefetch_enabled(args, torch.device("cuda", 0)) and not prefetch_enabled(args, torch.device("cpu"))
    assert prefetch_enabled(argparse.Namespace(prefetch_microbatches="on"), torch.device("cpu"))
    assert not prefetch_enabled(argparse.Namespace(prefetch_microbatches="off"), torch.device("cuda", 0))


def test_tensors_in_finds_every_tensor_of_a_prepared_batch():
    a, b, c, d = (torch.zeros(2) for _ in range(4))
    prepared = PreparedBatch(latents=a, sigmas=b, embeds=Conditioning({"prompt_embeds": c}), extras={"noise": [d]})
    assert {id(t) for t in tensors_in(prepared)} == {id(a), id(b), id(c), id(d)}
