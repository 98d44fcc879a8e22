"""Micro-batch prefetch on CUDA: the prepare's host-to-device copies on a side stream give the same tensors, ready
on the trunk's stream, as preparing in line."""

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub.types import PreparedBatch
from miles.backends.fsdp_utils.microbatch import MicroBatch
from miles.backends.fsdp_utils.prefetch import MicrobatchPrefetcher

pytestmark = pytest.mark.gpu


def prepare(ctx, batch, *, microbatch_id, optim_step_idx, pad_to_len=None):
    noise = torch.randn(batch["x"].shape, generator=torch.Generator().manual_seed(microbatch_id))
    return PreparedBatch(
        latents=batch["x"].to("cuda"), sigmas=batch["s"].to("cuda"), embeds=None, extras={"noise": noise.to("cuda")}
    )


def test_side_stream_prefetch_gives_the_inline_results_on_the_current_stream():
    pairs = {"x": torch.randn(64, 4, 32, 32), "s": torch.rand(64)}
    window = [MicroBatch(microbatch_id=i, start=8 * i, end=8 * i + 8) for i in range(8)]
    device = torch.device("cuda", torch.cuda.current_device())
    results = {}
    for enabled in (False, True):
        prefetcher = MicrobatchPrefetcher(enabled, device)
        out = []
        for _, _, prepared in prefetcher.prepared(prepare, None, pairs, window, 0):
            # work on the current stream, as the forward would, right after the batch is handed over
            out.append((prepared.latents * 2 + prepared.extras["noise"]).sum(dim=(1, 2, 3)).cpu())
        prefetcher.shutdown()
        results[enabled] = torch.stack(out)
    assert torch.equal(results[True], results[False])
