"""The awm conversion: K pairs per sample, one grid timestep per stratum of [1, int(0.9·N)) drawn from a seeded
stream, sample-major rows of clean latents, an unwritten old log-prob; and the sampler the request asks for."""

import pytest
import torch

from miles.arguments.parser import default_args
from miles.diffusion.schedule import sampling_sigmas
from miles.models.conditioning import Conditioning
from miles.rollout.engine_api import GenerateResult
from miles.rollout.rollout_hub.awm import awm_pairs, awm_pairs_count, awm_request
from miles.utils.types import Sample

B, L, D = 3, 5, 6
LATENT = (2, 3, 2, 2)  # (C, F, H, W): nothing here is SD3's shape
NUM_STEPS = 14
STRATA = [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]  # floor(linspace(1, int(0.9·14) = 12, 7))


def make_result(seed=0):
    g = torch.Generator().manual_seed(seed)
    return GenerateResult(
        images=None,
        final_latents=torch.randn(B, *LATENT, generator=g),
        latents=torch.zeros(B, 0, *LATENT),
        next_latents=torch.zeros(B, 0, *LATENT),
        log_probs=torch.zeros(B, 0),
        sigmas=sampling_sigmas(NUM_STEPS),
        trained_steps=[],
        conditioning=Conditioning({"prompt_embeds": torch.randn(B, L, D, generator=g)}),
        negative=None,
        weights_version=0,
    )


def make_args(**overrides):
    values = dict(awm_train_timesteps=6, awm_timestep_fraction=0.9, rollout_seed=1, awm_sampler="ode")
    return default_args(**{**values, **overrides})


def convert(result, rollout_id=3, **overrides):
    advantages = torch.tensor([1.5, -0.5, 0.0])
    return awm_pairs(make_args(**overrides), [], result, advantages, rollout_id=rollout_id)


def test_each_sample_trains_one_grid_timestep_per_stratum():
    result = make_result()
    pairs = convert(result)
    assert awm_pairs_count(make_args(), None) == 6
    index = pairs["step_index"].reshape(B, 6)
    for b in range(B):
        assert all(lo <= i < hi for i, (lo, hi) in zip(index[b].tolist(), STRATA))
    assert torch.equal(pairs["t"], result.sigmas[pairs["step_index"]])  # σ from the sampler's own grid


def test_rows_are_sample_major_clean_latents_with_an_unwritten_old_log_prob():
    result = make_result()
    pairs = convert(result)
    for row in range(B * 6):
        assert torch.equal(pairs["x0"][row], result.final_latents[row // 6])
        assert pairs["sample_index"][row] == row // 6
    assert pairs["advantage"].tolist() == [1.5] * 6 + [-0.5] * 6 + [0.0] * 6
    assert torch.isnan(pairs["old_log_prob"]).all()  # the recompute pass writes windows 1..; window 0 never reads it


def test_draws_repeat_per_seed_rollout_and_sample_and_differ_across_them():
    result = make_result()
    first = convert(result)["step_index"]
    assert torch.equal(first, convert(result)["step_index"])  # a rerun or a resume draws the same
    assert not torch.equal(first, convert(result, rollout_id=4)["step_index"])
    assert not torch.equal(first, convert(result, rollout_seed=2)["step_index"])
    rows = first.reshape(B, 6)
    assert len({tuple(r.tolist()) for r in rows}) > 1  # per sample, not one set for the batch


@pytest.mark.parametrize(("sampler", "sde_type", "trained"), [("ode", "ode", []), ("sde", "sde", [0, 1, 2, 3, 4])])
def test_request_samples_with_the_chosen_sampler(sampler, sde_type, trained):
    args = default_args(
        awm_sampler=sampler,
        diffusion_sde_type="sde",
        diffusion_num_steps=6,
        diffusion_num_sde_steps=0,  # all but the last step
        diffusion_sde_window_range=None,
        diffusion_step_strategy_path=None,
        diffusion_shared_initial_noise=False,
        diffusion_guidance_scale=1.0,
        diffusion_noise_level=0.7,
        negative_prompt="",
        rollout_seed=0,
    )
    samples = [Sample(index=i, prompt="a red circle", seed=i) for i in range(2)]
    request = awm_request(args, samples, rollout_id=0, resolution=16)
    assert request.sde_type == sde_type and request.trained_steps == trained
