"""Engines in micro-batches (`--rollout-micro-batch-size`): the same samples as one batch, bit for bit for an image
family (SD3) and a video family (Wan) where the CPU kernels compute a row alike at both batch sizes; the auto rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateRequest
from miles.rollout.micro_batches import (
    CUDA_FORWARD_POSITIONS,
    EngineProgress,
    micro_batch_bounds,
    resolve_rollout_micro_batch_size,
)
from miles.utils.threads import torch_threads

COMPARED = ("final_latents", "latents", "next_latents", "log_probs")


def sampling(batch: int, guidance_scale: float) -> GenerateRequest:
    return GenerateRequest(
        prompts=[f"{n} red circles on the left" for n in range(batch)],
        seeds=list(range(100, 100 + batch)),
        num_steps=2,
        guidance_scale=guidance_scale,
        negative_prompt="blurry",
        sde_type="sde",
        noise_level=0.7,
        trained_steps=[0],
        decode=True,
    )


def generate(engine: DiffusionEngine, req: GenerateRequest, micro_batch_size: int | str):
    engine.micro_batch_size = micro_batch_size
    with torch_threads(1):  # MKL computes a row alike in forwards of 4 rows or more at one thread (AVX2), of 11 or more
        return engine.generate(req)  # on an AVX-512 CPU (its 2-D GEMMs of 2-10 rows round otherwise)


# CFG doubles the rows: SD3's 14 samples in micro-batches of 8 (then 6) run forwards of 16 and 12 rows, the whole
# batch one of 28 (on both kinds of CPU above, and with a last micro-batch of another size); without CFG 8 samples in
# two of 4; Wan's 4 guided clips in two forwards of 4 rows (its tiny layers agree at 4 and 8 rows on both)
@pytest.mark.parametrize(
    ("fixture", "batch", "guidance_scale", "size"),
    [("tiny_pipeline_dir", 14, 4.5, 8), ("tiny_pipeline_dir", 8, 1.0, 4), ("tiny_wan_dir", 4, 4.5, 2)],
)
def test_micro_batches_give_the_samples_of_one_batch_bit_for_bit(fixture, batch, guidance_scale, size, request):
    engine = DiffusionEngine(request.getfixturevalue(fixture))
    req = sampling(batch, guidance_scale)
    whole, parts = generate(engine, req, "auto"), generate(engine, req, size)
    count, steps = len(micro_batch_bounds(batch, size)), engine.progress()
    assert (steps.micro_batches, steps.steps_done, steps.phase) == (count, count * req.num_steps, "idle")
    for name in COMPARED:
        assert torch.equal(getattr(parts, name), getattr(whole, name)), name
    assert np.array_equal(parts.images, whole.images)
    for name in whole.conditioning:
        assert torch.equal(parts.conditioning[name], whole.conditioning[name]), name
    if fixture == "tiny_pipeline_dir" and guidance_scale > 1:
        # one sample per forward (2 rows): MKL's small-matrix kernels round differently; the samples still agree
        single = generate(engine, req, 1)
        for name in COMPARED:
            assert (getattr(single, name) - getattr(whole, name)).abs().max() <= 1e-5, name


def test_auto_is_the_whole_share_on_cpu_and_a_bounded_forward_on_cuda():
    image, clip = (16, 128, 128), (16, 21, 60, 104)  # SD3 at 1024 px; Wan 81 frames at 480x832
    assert resolve_rollout_micro_batch_size("auto", latent_shape=image, guided=True, device_type="cpu") is None
    assert resolve_rollout_micro_batch_size(3, latent_shape=image, guided=True, device_type="cuda") == 3
    assert resolve_rollout_micro_batch_size("auto", latent_shape=image, guided=True, device_type="cuda") == 8
    assert resolve_rollout_micro_batch_size("auto", latent_shape=image, guided=False, device_type="cuda") == 16
    assert resolve_rollout_micro_batch_size("auto", latent_shape=clip, guided=True, device_type="cuda") == 1
    assert 2 * 21 * 60 * 104 <= CUDA_FORWARD_POSITIONS  # one guided clip always fits the rule
    assert micro_batch_bounds(5, 2) == [(0, 2), (2, 4), (4, 5)] and micro_batch_bounds(5, None) == [(0, 5)]


def test_progress_describes_where_the_call_is():
    report = EngineProgress(ticks=9, phase="denoise", steps_done=7, steps_total=20, micro_batch=2, micro_batches=4,
                            samples=4)  # fmt: skip
    assert report.describe() == "step 7/20, micro-batch 2/4 of 4 samples"
    assert EngineProgress().describe() == "idle"
