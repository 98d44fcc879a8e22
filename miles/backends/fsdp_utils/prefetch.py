"""Micro-batch prefetch (`--prefetch-microbatches`): the prepare hook of micro-batch n+1 runs on a worker thread
while the trunk runs the forward and backward of micro-batch n.

The hook is called exactly as without prefetch: one call per micro-batch, in order, with the same
(microbatch_id, optim_step_idx, pad_to_len), one at a time (a single worker), with the caller's grad mode. Prefetch
never crosses a window: the optimizer step between windows changes the weights a prepare hook may read. Prepare hooks draw their
noise from generators seeded by those ids, so results are bit-identical with and without prefetch.

On CUDA the worker prepares on a side stream, so the host-to-device copies of n+1 overlap n's kernels; the trunk's
stream waits for that copy before using the tensors, which are marked as used there (`record_stream`) so that the
caching allocator does not hand their memory to the side stream while n+1's kernels still read it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from miles.backends.fsdp_utils.loss_hub.types import PreparedBatch
from miles.backends.fsdp_utils.microbatch import MicroBatch
from miles.utils.types import TrainPairs, slice_pairs

PrepareFn = Callable[..., PreparedBatch]
# The width a prepare pads a micro-batch's sequences to. Train pairs are columns, one tensor each for the rank's whole
# shard (the rollout side pads variable-length conditioning to one width when it builds them, `Conditioning.cat`), so
# a micro-batch, a slice of rows, already has that width and no loop pads one: the trunk passes None, explicitly.
PAD_TO_LEN: int | None = None


def prefetch_enabled(args: argparse.Namespace, device: torch.device) -> bool:
    """`auto`: on CUDA only, where the copies overlap the kernels; on CPU the prepare is a few slices that the
    forward's own threads would compete with."""
    mode = getattr(args, "prefetch_microbatches", "auto")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor a prepared batch holds: in its fields, mappings (conditioning, extras), lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors_in(getattr(value, f.name))
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def call_prepare(prepare: PrepareFn, ctx: Any, batch: TrainPairs, mb: MicroBatch, optim_step_idx: int) -> PreparedBatch:
    """The trunk's one prepare call (both loops, with or without prefetch): all three keywords of the contract."""
    return prepare(ctx, batch, microbatch_id=mb.microbatch_id, optim_step_idx=optim_step_idx, pad_to_len=PAD_TO_LEN)


class MicrobatchPrefetcher:
    """One worker thread (and on CUDA one side stream) per trainer rank, reused by every window."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled, self.device = enabled, device
        self._executor: ThreadPoolExecutor | None = None
        self._stream = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None

    def prepared(
        self,
        prepare: PrepareFn,
        ctx: Any,
        pairs: TrainPairs,
        window: Sequence[MicroBatch],
        optim_step_idx: int,
    ) -> Iterator[tuple[MicroBatch, TrainPairs, PreparedBatch]]:
        """(micro-batch, its pairs, its prepared batch) for each micro-batch of one window, in order."""

        def one(mb: MicroBatch, grad: bool) -> tuple[MicroBatch, TrainPairs, PreparedBatch, Any]:
            batch = slice_pairs(pairs, mb.start, mb.end)
            with torch.set_grad_enabled(grad):
                if self._stream is None:
                    return mb, batch, call_prepare(prepare, ctx, batch, mb, optim_step_idx), None
                with torch.cuda.stream(self._stream):
                    prepared = call_prepare(prepare, ctx, batch, mb, optim_step_idx)
                    ready = torch.cuda.Event()
                    ready.record(self._stream)
            return mb, batch, prepared, ready

        grad = torch.is_grad_enabled()
        if not self.enabled or len(window) < 2:
            for mb in window:
                yield one(mb, grad)[:3]
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-prefetch")
        future = self._executor.submit(one, window[0], grad)
        for index in range(len(window)):
            mb, batch, prepared, ready = future.result()
            if index + 1 < len(window):  # n+1's prepare runs while the caller computes n
                future = self._executor.submit(one, window[index + 1], grad)
            if ready is not None:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(ready)
                for tensor in tensors_in(prepared):
                    if tensor.device.type == "cuda":
                        tensor.record_stream(stream)
            yield mb, batch, prepared

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
