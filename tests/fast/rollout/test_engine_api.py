"""What a rollout engine takes and returns (miles/rollout/engine_api.py): a request checked as it is built and cut
into rows, results joined along the batch (one weights version, the compile counters' largest), and the noise a
sample's seed stands for, whatever its batch-mates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.models.conditioning import Conditioning
from miles.rollout.engine_api import GenerateResult, draw_sample_noise
from tests.fast.rollout.test_engine import PROMPTS, SEEDS, request


def test_request_validation():
    with pytest.raises(ValueError, match="2 prompts but 1 seeds"):
        request(prompts=PROMPTS[:2], seeds=[1])
    with pytest.raises(ValueError, match="4 seeds but 1 initial_seeds"):
        request(initial_seeds=[1])
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        request(trained_steps=[3])
    with pytest.raises(ValueError, match="sorted, unique"):
        request(trained_steps=[1, 0])
    with pytest.raises(ValueError, match="--diffusion-sde-type"):
        request(sde_type="euler")
    with pytest.raises(ValueError, match="needs an SDE window"):
        request(trained_steps=[], flash_ratio=0.4)


def test_a_requests_rows_keep_each_prompts_seeds_and_source_images():
    sources = [[np.full((2, 2, 3), i, dtype=np.uint8)] for i in range(4)]
    part = request(initial_seeds=[5, 6, 7, 8], source_images=sources).rows(1, 3)
    assert (part.prompts, part.seeds, part.initial_seeds) == (PROMPTS[1:3], SEEDS[1:3], [6, 7])
    assert part.source_images == sources[1:3] and part.num_steps == 4
    with pytest.raises(ValueError, match="4 prompts but 1 source image lists"):
        request(source_images=sources[:1])
    with pytest.raises(ValueError, match="--diffusion-num-steps must be >= 1, got 0"):
        request(num_steps=0, trained_steps=[])
    assert request(sde_type="renoise", trained_steps=[0, 3]).trained_steps == [0, 3]  # renoise trains the last step
    assert request(sde_type="ode", trained_steps=[0, 3]).trained_steps == [0, 3]  # reward gradients record them


def result(rows: int, version: int = 1, counters: dict[str, float] | None = None) -> GenerateResult:
    latents = torch.arange(rows, dtype=torch.float32).view(rows, 1, 1).expand(rows, 2, 3)
    return GenerateResult(
        images=np.zeros((rows, 4, 4, 3), dtype=np.uint8),
        final_latents=latents[:, 0],
        latents=latents,
        next_latents=latents + 1,
        log_probs=torch.zeros(rows, 2),
        sigmas=torch.linspace(1, 0, 5),
        trained_steps=[0, 1],
        conditioning=Conditioning({"prompt_embeds": torch.full((rows, 3), float(rows))}),
        negative=Conditioning({"prompt_embeds": torch.zeros(1, 3)}),
        weights_version=version,
        compile_counters=counters,
    )


def test_results_join_in_order_along_the_batch():
    joined = GenerateResult.concat([result(1, counters={"graphs": 2.0, "recompiles": 0.0}), result(2, counters=None)])
    assert joined.batch_size == 3 and joined.images.shape == (3, 4, 4, 3)
    assert joined.final_latents[:, 0].tolist() == [0.0, 0.0, 1.0]
    assert joined.conditioning["prompt_embeds"][:, 0].tolist() == [1.0, 2.0, 2.0]
    assert joined.negative["prompt_embeds"].shape == (1, 3)  # one shared negative row
    assert joined.compile_counters == {"graphs": 2.0, "recompiles": 0.0}
    both = GenerateResult.concat([result(1, counters={"graphs": 2.0}), result(1, counters={"graphs": 5.0})])
    assert both.compile_counters == {"graphs": 5.0}  # each counter's largest over the engines


def test_results_of_different_weights_versions_are_refused():
    with pytest.raises(ValueError, match=r"different weights versions \[1, 2\]: a weight sync was missed"):
        GenerateResult.concat([result(1, version=1), result(1, version=2)])
    with pytest.raises(ValueError, match="needs at least one result"):
        GenerateResult.concat([])


def test_a_samples_noise_depends_on_its_seed_only():
    noise = draw_sample_noise([3, 4], num_steps=2, shape=(2, 2))
    alone = draw_sample_noise([4], num_steps=2, shape=(2, 2))
    assert noise.shape == (2, 3, 2, 2) and torch.equal(noise[1], alone[0])
    generator = torch.Generator().manual_seed(3)
    assert all(torch.equal(noise[0, i], torch.randn((2, 2), generator=generator)) for i in range(3))
    swapped = draw_sample_noise([3, 4], num_steps=2, shape=(2, 2), initial_seeds=[4, 3])
    assert torch.equal(swapped[0, 0], noise[1, 0]) and torch.equal(swapped[0, 1:], noise[0, 1:])
    ones = draw_sample_noise([1], num_steps=1, shape=(2,), draw=lambda g: torch.ones(2))
    assert torch.equal(ones, torch.ones(1, 2, 2))
