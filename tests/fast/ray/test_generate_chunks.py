"""--generate-chunk-size: each chunk is scored while the engines generate the next, and the samples, rewards and
result are those of generating and scoring the same chunks one after the other."""

from __future__ import annotations

import numpy as np
import torch

from miles.arguments.parser import default_args
from miles.arguments.records import RolloutFlags
from miles.models.conditioning import Conditioning
from miles.ray.rollout_manager import REWARD_TERMS, RolloutManager
from miles.rollout.engine_api import GenerateRequest, GenerateResult
from miles.utils.types import Sample


def fake_result(request: GenerateRequest) -> GenerateResult:
    """Per-row outputs that depend only on the row's seed (as the engine's do, up to the batch's float rounding)."""
    batch = len(request.prompts)
    images = np.stack([np.full((4, 4, 3), (seed * 37) % 256, dtype=np.uint8) for seed in request.seeds])
    return GenerateResult(
        images=images,
        final_latents=torch.tensor(request.seeds, dtype=torch.float32)[:, None].expand(batch, 8).clone(),
        latents=torch.zeros(batch, 0, 8),
        next_latents=torch.zeros(batch, 0, 8),
        log_probs=torch.zeros(batch, 0),
        sigmas=torch.linspace(1, 0, 3),
        trained_steps=[],
        conditioning=Conditioning({"prompt_embeds": torch.zeros(batch, 1, 1)}),
        negative=None,
        weights_version=0,
    )


class Engines:
    """submit / collect like RolloutEngineGroup, logging when each chunk starts and is waited for."""

    def __init__(self, events: list) -> None:
        self.events = events

    def submit(self, request, rollout_id=None):
        self.events.append(("generate", tuple(request.seeds)))
        return fake_result(request)

    def collect(self, pending):
        return pending

    def generate(self, request, rollout_id=None):
        return self.collect(self.submit(request, rollout_id))


class Rewards:
    def __init__(self, events: list) -> None:
        self.events = events

    def score(self, samples, rollout_id=None):
        self.events.append(("score", tuple(s.seed for s in samples)))
        totals = [float(s.image.mean()) / 255 for s in samples]
        return totals, {"brightness": totals}


def ode_request(samples: list[Sample]) -> GenerateRequest:
    return GenerateRequest(
        prompts=[s.prompt for s in samples],
        seeds=[s.seed for s in samples],
        num_steps=2,
        guidance_scale=1.0,
        negative_prompt="",
        sde_type="ode",
        noise_level=0.0,
        trained_steps=[],
    )


def run(chunk: int) -> tuple[list[Sample], GenerateResult, list]:
    events: list = []
    manager = RolloutManager.__new__(RolloutManager)
    manager.flags = RolloutFlags.from_args(default_args(generate_chunk_size=chunk))
    manager.hooks, manager.engines, manager.rewards = {}, Engines(events), Rewards(events)
    seeds = [3, 11, 5, 8, 1]
    samples = [Sample(index=i, prompt=f"p{i}", seed=seed) for i, seed in enumerate(seeds)]
    result = manager._generate_and_score(samples, ode_request(samples), rollout_id=0)
    return samples, result, events


def test_each_chunk_is_scored_while_the_next_generates_with_the_same_results():
    whole, whole_result, whole_events = run(0)
    assert whole_events == [("generate", (3, 11, 5, 8, 1)), ("score", (3, 11, 5, 8, 1))]
    chunked, result, events = run(2)
    assert events == [
        ("generate", (3, 11)),
        ("generate", (5, 8)),  # started before chunk 0 is scored
        ("score", (3, 11)),
        ("generate", (1,)),
        ("score", (5, 8)),
        ("score", (1,)),
    ]
    assert [s.reward for s in chunked] == [s.reward for s in whole]
    assert [s.extra[REWARD_TERMS] for s in chunked] == [s.extra[REWARD_TERMS] for s in whole]
    assert all(np.array_equal(a.image, b.image) for a, b in zip(chunked, whole))
    assert np.array_equal(result.images, whole_result.images)
    assert torch.equal(result.final_latents, whole_result.final_latents)


def test_no_chunking_without_rewards_to_score():
    manager = RolloutManager.__new__(RolloutManager)
    events: list = []
    manager.flags = RolloutFlags.from_args(default_args(generate_chunk_size=2))
    manager.hooks, manager.engines, manager.rewards = {}, Engines(events), None
    samples = [Sample(index=i, prompt="p", seed=i) for i in range(4)]
    manager._generate_and_score(samples, ode_request(samples), rollout_id=0)
    assert events == [("generate", (0, 1, 2, 3))]  # one batch: nothing to overlap with
