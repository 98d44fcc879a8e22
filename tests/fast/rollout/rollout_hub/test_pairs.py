"""The shared SDE rollout side (Flow-GRPO, GRPO-Guard, Flow-DPPO, custom_loss): the SDE request from the sampling flags and the step strategy, and its pairs (one
transition per (sample, trained step), sample-major) checked against a plain loop over samples and steps.

Latents have video rank (C, F, H, W) and the conditioning carries a mask: nothing here is SD3's shape."""

from types import SimpleNamespace

import pytest
import torch

from miles.arguments.parser import default_args
from miles.diffusion.schedule import sampling_sigmas
from miles.models.conditioning import Conditioning
from miles.rollout.engine_api import GenerateResult
from miles.rollout.requests import sde_request
from miles.rollout.rollout_hub.pairs import sde_pairs, trained_steps_per_sample
from miles.utils.types import Sample

B, L, D, NUM_STEPS = 3, 4, 5, 6
LATENT = (2, 3, 2, 2)


def make_result(trained_steps, cfg=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = len(trained_steps)

    def cond(batch):
        return Conditioning(
            {"prompt_embeds": torch.randn(batch, L, D, generator=g), "mask": torch.rand(batch, L) > 0.3}
        )

    return GenerateResult(
        images=None,
        final_latents=torch.randn(B, *LATENT, generator=g),
        latents=torch.randn(B, k, *LATENT, generator=g),
        next_latents=torch.randn(B, k, *LATENT, generator=g),
        log_probs=torch.randn(B, k, generator=g),
        sigmas=sampling_sigmas(NUM_STEPS),
        trained_steps=list(trained_steps),
        conditioning=cond(B),
        negative=cond(1) if cfg else None,
        weights_version=0,
    )


def convert(result, advantages):
    return sde_pairs(SimpleNamespace(), [], result, advantages, rollout_id=0)


def test_pairs_are_the_transitions_of_each_sample_in_sample_major_order():
    trained = [1, 2, 4]
    result, advantages = make_result(trained), torch.tensor([0.5, -1.0, 2.0])
    pairs = convert(result, advantages)
    sigmas = result.sigmas
    row = 0
    for b in range(B):
        for k, step in enumerate(trained):
            assert torch.equal(pairs["latents"][row], result.latents[b, k])
            assert torch.equal(pairs["next_latents"][row], result.next_latents[b, k])
            assert pairs["sigma"][row] == sigmas[step] and pairs["sigma_next"][row] == sigmas[step + 1]
            assert pairs["sigma_max"][row] == sigmas[1]
            assert pairs["rollout_log_prob"][row] == result.log_probs[b, k] == pairs["old_log_prob"][row]
            assert pairs["advantage"][row] == advantages[b]
            assert pairs["sample_index"][row] == b and pairs["step_index"][row] == step
            assert torch.equal(pairs["cond/prompt_embeds"][row], result.conditioning["prompt_embeds"][b])
            assert torch.equal(pairs["cond/mask"][row], result.conditioning["mask"][b])
            row += 1
    assert all(v.shape[0] == B * len(trained) for v in pairs.values())
    assert not any(name.startswith("negative_") for name in pairs)
    pairs["old_log_prob"][0] = 99.0  # the trainer overwrites old log-probs: they must not alias the rollout's
    assert pairs["rollout_log_prob"][0] != 99.0


def test_negative_conditioning_is_copied_to_every_pair_when_sampled_with_cfg():
    result = make_result([0, 3], cfg=True)
    pairs = convert(result, torch.zeros(B))
    assert pairs["negative_cond/prompt_embeds"].shape == (B * 2, L, D)
    for row in range(B * 2):
        assert torch.equal(pairs["negative_cond/prompt_embeds"][row], result.negative["prompt_embeds"][0])
    assert pairs["negative_cond/mask"].stride(0) != 0  # copies, not a broadcast view


def test_no_trained_steps_is_an_error():
    with pytest.raises(ValueError, match="no trained steps"):
        convert(make_result([]), torch.zeros(B))


def sampling_args(**overrides):
    values = dict(
        diffusion_num_steps=NUM_STEPS,
        diffusion_num_sde_steps=None,
        diffusion_sde_window_range=None,
        diffusion_step_strategy_path=None,
        diffusion_guidance_scale=4.5,
        negative_prompt="blurry",
        diffusion_sde_type="cps",
        diffusion_noise_level=0.7,
        diffusion_shared_initial_noise=False,
        rollout_seed=3,
    )
    values.update(overrides)
    return default_args(**values)


def test_the_request_samples_the_sde_kernel_on_the_strategys_steps():
    samples = [Sample(index=i, prompt=f"p{i}", seed=10 + i, group_index=i // 2) for i in range(4)]
    request = sde_request(sampling_args(), samples, rollout_id=2, resolution=32)
    assert request.prompts == ["p0", "p1", "p2", "p3"] and request.seeds == [10, 11, 12, 13]
    assert request.sde_type == "cps" and request.noise_level == 0.7 and request.num_steps == NUM_STEPS
    assert request.guidance_scale == 4.5 and request.negative_prompt == "blurry" and request.resolution == 32
    assert request.trained_steps == list(range(NUM_STEPS - 1))  # every step but the last (tiny σ')
    assert request.initial_seeds is None
    assert trained_steps_per_sample(None, request) == NUM_STEPS - 1
    shared = sde_request(sampling_args(diffusion_shared_initial_noise=True), samples, rollout_id=2, resolution=32)
    assert shared.initial_seeds == [10, 10, 12, 12]  # each group starts from its first sample's latent


def test_the_request_asks_for_flash_after_the_mixgrpo_window():
    samples = [Sample(index=i, prompt=f"p{i}", seed=10 + i, group_index=i // 2) for i in range(4)]
    mixgrpo = dict(
        diffusion_num_steps=8,
        mixgrpo_window_size=2,
        mixgrpo_mode="progressive",
        mixgrpo_shift_interval=1,
        mixgrpo_stride=1,
        mixgrpo_flash_ratio=0.4,
    )
    flash = sde_request(sampling_args(**mixgrpo, mixgrpo_flash=True), samples, rollout_id=3, resolution=32)
    assert flash.trained_steps == [3, 4] and flash.flash_ratio == 0.4
    plain = sde_request(sampling_args(**mixgrpo, mixgrpo_flash=False), samples, rollout_id=3, resolution=32)
    assert plain.trained_steps == [3, 4] and plain.flash_ratio is None
    assert sde_request(sampling_args(), samples, rollout_id=3, resolution=32).flash_ratio is None


def test_recorded_step_pairs_carry_the_step_the_grid_tail_the_clean_sample_and_the_metadata():
    from miles.rollout.rollout_hub.pairs import REWARD_METADATA, recorded_step_pairs
    from miles.utils.json_column import decode_json_column

    result = make_result([3], cfg=True)
    samples = [Sample(index=i, prompt=f"p{i}", metadata={"color": "red"} if i else {}) for i in range(B)]
    pairs = recorded_step_pairs(SimpleNamespace(loss_type="refl"), samples, result, None, rollout_id=0)
    assert torch.equal(pairs["latents"], result.latents[:, 0]) and torch.equal(
        pairs["final_latents"], result.final_latents
    )
    assert torch.equal(pairs["next_latents"], result.next_latents[:, 0])
    assert bool((pairs["sigma"] == result.sigmas[3]).all()) and bool((pairs["sigma_next"] == result.sigmas[4]).all())
    assert torch.equal(pairs["sigma_tail"][1], result.sigmas[3:]) and pairs["step_index"].tolist() == [3] * B
    assert decode_json_column(pairs[REWARD_METADATA]) == [
        {"prompt": "p0"},
        {"color": "red", "prompt": "p1"},
        {"color": "red", "prompt": "p2"},
    ]
    assert pairs["negative_cond/prompt_embeds"].shape[0] == B
    with pytest.raises(ValueError, match="one recorded step per sample"):
        recorded_step_pairs(SimpleNamespace(loss_type="refl"), samples, make_result([1, 3]), None, rollout_id=0)
