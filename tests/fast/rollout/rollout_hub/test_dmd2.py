"""The dmd2 rollout: the engine's renoise generator run (backward simulation to step j) and its conversion to
one train pair per sample, checked against a hand-written loop over the tiny transformer."""

from types import SimpleNamespace

import pytest
import torch

from miles.diffusion.sde import renoise_sigmas
from miles.models.base import get_train_pipeline_config
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateRequest, draw_sample_noise
from miles.rollout.rollout_hub.dmd2 import dmd2_trained_step, generator_pairs


def convert(result):
    """The spec's converter, plain dmd2 (no reward term: no sample is read)."""
    return generator_pairs(SimpleNamespace(dmd2_reward_weight=0.0), [], result, None, rollout_id=0)


PROMPTS = ["a red circle", "two blue squares on the left", "a green triangle"]
SEEDS = [5, 6, 7]


def dmd2_request(k, j, **overrides):
    values = dict(
        prompts=PROMPTS,
        seeds=SEEDS,
        num_steps=k,
        guidance_scale=1.0,
        negative_prompt="",
        sde_type="renoise",
        noise_level=0.0,
        trained_steps=[j],
        decode=False,
        return_negative=True,
    )
    values.update(overrides)
    return GenerateRequest(**values)


@pytest.fixture(scope="module")
def engine(tiny_pipeline_dir):
    return DiffusionEngine(tiny_pipeline_dir)


@pytest.fixture(scope="module")
def family(tiny_pipeline_dir):
    fam = get_train_pipeline_config(tiny_pipeline_dir)
    fam.load_text_encoders()
    return fam


@pytest.fixture(scope="module")
def transformer(family):
    return family.load_transformer().requires_grad_(False)


@pytest.mark.parametrize(("k", "j"), [(1, 0), (3, 0), (3, 1), (3, 2)])
def test_pairs_hold_the_generator_input_and_output_at_step_j(engine, family, transformer, k, j):
    result = engine.generate(dmd2_request(k, j))
    pairs = convert(result)
    grid = renoise_sigmas(k, family.scheduler_shift)
    embeds = family.encode_prompts(PROMPTS)
    noise = draw_sample_noise(SEEDS, k, family.latent_shape())
    x = noise[:, 0]
    with torch.no_grad():  # backward simulation by hand: x̂₀ at each step, re-noised with the sample's noise
        for i in range(j + 1):
            sigma = grid[i].expand(len(SEEDS))
            x0_hat = x - grid[i] * family.predict_velocity(transformer, x, sigma, embeds)
            if i < j:
                x = (1 - grid[i + 1]) * x0_hat + grid[i + 1] * noise[:, i + 1]
    torch.testing.assert_close(pairs["latents"], x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pairs["x"], x0_hat, rtol=1e-5, atol=1e-5)
    assert torch.equal(pairs["sigma"], grid[j].expand(len(SEEDS)))
    if j == 0:
        assert torch.equal(pairs["latents"], noise[:, 0]) and bool((pairs["sigma"] == 1.0).all())
    if j == k - 1:  # the last step's x̂₀ is the generator's output
        torch.testing.assert_close(result.final_latents, pairs["x"])
    for name in embeds:
        assert pairs[f"negative_cond/{name}"].shape == pairs[f"cond/{name}"].shape
        torch.testing.assert_close(pairs[f"cond/{name}"], embeds[name])
    assert pairs["sample_index"].tolist() == [0, 1, 2] and pairs["step_index"].tolist() == [j] * 3
    assert bool(result.log_probs.isnan().all())


def test_conversion_needs_the_renoise_outputs_and_negative_embeddings(engine):
    with pytest.raises(ValueError, match="renoise"):
        convert(engine.generate(dmd2_request(3, 0, sde_type="sde", noise_level=0.7)))
    with pytest.raises(ValueError, match="negative prompt"):
        convert(engine.generate(dmd2_request(2, 0, return_negative=False)))


def test_request_allows_training_the_last_generator_step_only_for_renoise():
    dmd2_request(2, 1)
    with pytest.raises(ValueError, match="trained_steps"):
        dmd2_request(2, 1, sde_type="sde")


def test_trained_step_is_seeded_and_covers_the_grid():
    draws = [dmd2_trained_step(4, seed=42, rollout_id=r) for r in range(64)]
    assert draws == [dmd2_trained_step(4, seed=42, rollout_id=r) for r in range(64)]
    assert set(draws) == {0, 1, 2, 3}
    assert {dmd2_trained_step(1, seed=42, rollout_id=r) for r in range(8)} == {0}
