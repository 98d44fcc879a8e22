"""Source images through the rollout: samples share their record's loaded images, a per-prompt negative (a family
whose negative encodes the image) reaches each sample's pairs, chunked results keep it in order, grids show the
source before the results, the reward wire format carries the sources, and a text family refuses them."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles.diffusion.schedule import sampling_sigmas
from miles.models import get_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.rollout.engine_api import GenerateRequest, GenerateResult
from miles.rollout.media_files import beside_sources, first_sources
from miles.rollout.requests import source_images_of
from miles.rollout.rm_hub.remote import decode_sample, encode_sample
from miles.rollout.rollout_hub.pairs import sde_pairs
from miles.rollout.steps import make_samples

B, K = 3, 2
SOURCES = [[np.full((8, 8, 3), 40 * b, np.uint8)] for b in range(B)]


def result_with_negative(rows: int) -> GenerateResult:
    g = torch.Generator().manual_seed(0)
    return GenerateResult(
        images=None,
        final_latents=torch.randn(B, 4, 2, 2, generator=g),
        latents=torch.randn(B, K, 4, 2, 2, generator=g),
        next_latents=torch.randn(B, K, 4, 2, 2, generator=g),
        log_probs=torch.randn(B, K, generator=g),
        sigmas=sampling_sigmas(4),
        trained_steps=[0, 1],
        conditioning=Conditioning({"prompt_embeds": torch.randn(B, 3, 5, generator=g)}),
        negative=Conditioning(
            {"prompt_embeds": torch.arange(rows, dtype=torch.float32)[:, None, None].expand(rows, 3, 5)}
        ),
        negative_per_prompt=rows > 1,
        weights_version=0,
    )


def test_samples_of_a_record_share_its_source_images_loaded_at_the_resolution():
    args = argparse.Namespace(n_samples_per_prompt=2, rollout_seed=0)
    records = [{"prompt": "make it red", "source_images": [np.zeros((16, 16, 3), np.uint8)]}, {"prompt": "text"}]
    samples = make_samples(args, records, [0], 0, resolution=8)
    assert [s.source_images[0].shape for s in samples] == [(8, 8, 3)] * 2
    assert samples[0].source_images[0] is samples[1].source_images[0]
    assert source_images_of(samples)[1][0] is samples[1].source_images[0]
    assert source_images_of(make_samples(args, records, [1], 0, resolution=8)) is None
    with pytest.raises(ValueError, match="resolution"):
        make_samples(args, records, [0], 0)


def test_a_per_prompt_negative_reaches_each_samples_pairs():
    pairs = sde_pairs(SimpleNamespace(), [], result_with_negative(B), torch.zeros(B), rollout_id=0)
    rows = pairs["negative_cond/prompt_embeds"][:, 0, 0]
    assert rows.tolist() == [b for b in range(B) for _ in range(K)]  # sample-major, as the pairs
    shared = sde_pairs(SimpleNamespace(), [], result_with_negative(1), torch.zeros(B), rollout_id=0)
    assert shared["negative_cond/prompt_embeds"].shape[0] == B * K


def test_chunked_results_concatenate_per_prompt_negatives_in_order():
    whole = result_with_negative(B)
    parts = []
    for start, end in [(0, 1), (1, 3)]:
        part = dataclasses.replace(
            whole,
            final_latents=whole.final_latents[start:end],
            latents=whole.latents[start:end],
            next_latents=whole.next_latents[start:end],
            log_probs=whole.log_probs[start:end],
            conditioning=whole.conditioning.rows(slice(start, end)),
            negative=whole.negative.rows(slice(start, end)),
        )
        parts.append(part)
    joined = GenerateResult.concat(parts)
    assert torch.equal(joined.negative["prompt_embeds"], whole.negative["prompt_embeds"])
    request = GenerateRequest(
        prompts=["a", "b", "c"],
        seeds=[1, 2, 3],
        num_steps=2,
        guidance_scale=1.0,
        negative_prompt="",
        sde_type="ode",
        noise_level=0.0,
        trained_steps=[],
        source_images=SOURCES,
    )
    assert request.rows(1, 3).source_images == SOURCES[1:]
    with pytest.raises(ValueError, match="source image lists"):
        dataclasses.replace(request, source_images=SOURCES[:2])


def test_grids_put_each_prompts_source_before_its_results():
    images = np.stack([np.full((2, 2, 3), 100 + i, np.uint8) for i in range(4)])
    sources = np.stack([np.full((2, 2, 3), g, np.uint8) for g in (1, 1, 2, 2)])
    tiles = beside_sources(images, sources, group=2)
    assert [int(t[0, 0, 0]) for t in tiles] == [1, 100, 101, 2, 102, 103]
    samples = make_samples(
        argparse.Namespace(n_samples_per_prompt=1, rollout_seed=0),
        [{"prompt": "p", "source_images": SOURCES[1]}],
        [0],
        0,
        resolution=8,
    )
    assert np.array_equal(first_sources(samples)[0], SOURCES[1][0])


def test_the_reward_wire_format_carries_the_source_images():
    samples = make_samples(
        argparse.Namespace(n_samples_per_prompt=1, rollout_seed=0),
        [{"prompt": "p", "source_images": SOURCES[2] * 2}],
        [0],
        0,
        resolution=8,
    )
    samples[0].image = np.full((8, 8, 3), 7, np.uint8)
    back = decode_sample(encode_sample(samples[0]), 0)
    assert len(back.source_images) == 2 and np.array_equal(back.source_images[1], SOURCES[2][0])
    with pytest.raises(ValueError, match=r"samples\[0\]\.source_images\[0\] is not a base64 PNG"):
        decode_sample({"prompt": "p", "source_images": ["xx"]}, 0)


def test_a_text_family_refuses_source_images(tiny_pipeline_dir):
    family = get_train_pipeline_config(tiny_pipeline_dir)
    assert not family.takes_source_images
    with pytest.raises(ValueError, match=r"generates from text only, but the prompts carry source images"):
        family.encode_request(["a"], [SOURCES[0]], "", negative=False)
