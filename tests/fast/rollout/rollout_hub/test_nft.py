"""The nft conversion: pairs per sample, distinct nonzero grid timesteps, seeded determinism, sample-major rows.

The result has video-rank latents (C, F, H, W) and a conditioning with a mask: nothing here is SD3's shape."""

from types import SimpleNamespace

import pytest
import torch

from miles.diffusion.schedule import sampling_sigmas
from miles.models.conditioning import Conditioning
from miles.rollout.engine_api import GenerateResult
from miles.rollout.rollout_hub.nft import nft_pairs, nft_pairs_count, nft_pairs_per_sample

B, L, D = 4, 5, 6
LATENT = (2, 3, 2, 2)  # (C, F, H, W)
NUM_STEPS = 10


def _conditioning(batch, g):
    return Conditioning({"prompt_embeds": torch.randn(batch, L, D, generator=g), "mask": torch.rand(batch, L) > 0.3})


def make_result(batch=B, num_steps=NUM_STEPS, cfg=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return GenerateResult(
        images=None,
        final_latents=torch.randn(batch, *LATENT, generator=g),
        latents=torch.zeros(batch, 0, *LATENT),
        next_latents=torch.zeros(batch, 0, *LATENT),
        log_probs=torch.zeros(batch, 0),
        sigmas=sampling_sigmas(num_steps),
        trained_steps=[],
        conditioning=_conditioning(batch, g),
        negative=_conditioning(1, g) if cfg else None,
        weights_version=0,
    )


def convert(result, fraction=0.6, seed=1, rollout_id=3, advantages=None):
    if advantages is None:
        advantages = torch.linspace(-1.0, 1.0, result.batch_size)
    args = SimpleNamespace(diffusion_nft_timestep_fraction=fraction, rollout_seed=seed)
    return nft_pairs(args, [], result, advantages, rollout_id=rollout_id)


@pytest.mark.parametrize("fraction, expected", [(0.6, 6), (1.0, 10), (0.01, 1), (0.25, 2), (0.99, 10)])
def test_pairs_per_sample_is_rounded_fraction_of_steps(fraction, expected):
    assert nft_pairs_per_sample(NUM_STEPS, fraction) == expected
    args = SimpleNamespace(diffusion_num_steps=NUM_STEPS, diffusion_nft_timestep_fraction=fraction)
    assert nft_pairs_count(args, None) == expected  # what the rollout orders the pairs by
    pairs = convert(make_result(), fraction=fraction)
    assert all(v.shape[0] == B * expected for v in pairs.values())


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_fraction_outside_unit_interval_is_rejected(fraction):
    with pytest.raises(ValueError, match="timestep-fraction"):
        convert(make_result(), fraction=fraction)


def test_each_sample_trains_on_distinct_nonzero_grid_timesteps():
    result = make_result()
    grid = result.sigmas[:-1].tolist()
    pairs = convert(result, fraction=1.0)
    t = pairs["t"].reshape(B, NUM_STEPS)
    for b in range(B):
        values = t[b].tolist()
        assert len(set(values)) == NUM_STEPS
        assert sorted(values) == sorted(grid)  # fraction 1: the whole grid but σ = 0
        assert min(values) > 0.0
    partial = convert(result, fraction=0.6)["t"].reshape(B, 6)
    for b in range(B):
        assert len(set(partial[b].tolist())) == 6 and set(partial[b].tolist()) <= set(grid)


def test_timesteps_are_deterministic_per_seed_and_rollout():
    result = make_result()
    first, again = convert(result), convert(result)
    assert torch.equal(first["t"], again["t"])
    other_rollout = convert(result, rollout_id=4)
    other_seed = convert(result, seed=2)
    assert not torch.equal(first["t"], other_rollout["t"])
    assert not torch.equal(first["t"], other_seed["t"])
    per_sample = first["t"].reshape(B, -1)
    assert len({tuple(row.tolist()) for row in per_sample}) > 1  # shuffled per sample, not one order for all


def test_columns_are_sample_major_with_expected_shapes():
    result = make_result()
    advantages = torch.tensor([0.5, -2.0, 3.0, 0.0])
    pairs = convert(result, fraction=0.3, advantages=advantages)
    k = 3
    assert set(pairs) == {"x0", "t", "advantage", "cond/prompt_embeds", "cond/mask", "sample_index"}
    assert pairs["x0"].shape == (B * k, *LATENT) and pairs["t"].shape == (B * k,)
    assert pairs["cond/prompt_embeds"].shape == (B * k, L, D) and pairs["cond/mask"].shape == (B * k, L)
    for row in range(B * k):
        b = row // k
        assert pairs["sample_index"][row] == b
        assert torch.equal(pairs["x0"][row], result.final_latents[b])
        assert pairs["advantage"][row] == advantages[b]
        assert torch.equal(pairs["cond/prompt_embeds"][row], result.conditioning["prompt_embeds"][b])
        assert torch.equal(pairs["cond/mask"][row], result.conditioning["mask"][b])
    assert pairs["cond/mask"].dtype == torch.bool
    assert all(v.dtype == torch.float32 for n, v in pairs.items() if n not in ("sample_index", "cond/mask"))


def test_negative_embeddings_travel_when_sampled_with_cfg():
    result = make_result(cfg=True)
    pairs = convert(result, fraction=0.2)
    assert pairs["negative_cond/prompt_embeds"].shape == (B * 2, L, D)
    assert torch.equal(pairs["negative_cond/prompt_embeds"][5], result.negative["prompt_embeds"][0])
    assert torch.equal(pairs["negative_cond/mask"][5], result.negative["mask"][0])
    assert pairs["negative_cond/mask"].shape == (B * 2, L)
    assert pairs["negative_cond/mask"].stride(0) != 0  # rows are copies, not a broadcast view


def test_advantages_must_be_one_per_sample():
    with pytest.raises(ValueError, match="one advantage per sample"):
        convert(make_result(), advantages=torch.zeros(B + 1))
