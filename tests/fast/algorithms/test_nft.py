"""The nft (DiffusionNFT) declaration's rules and what it declares, on the values the parser hands them."""

from __future__ import annotations

from types import SimpleNamespace

from miles.algorithms.base import OLD_POLICY
from miles.algorithms.nft import ALGORITHM, validate


def args(**values):
    defaults = {
        "diffusion_nft_kl_beta": 0.0,
        "ref_mode": "none",
        "diffusion_nft_guidance_scale": 1.0,
        "diffusion_guidance_scale": 1.0,
    }
    return SimpleNamespace(**{**defaults, **values})


def test_the_kl_needs_a_reference_and_training_cfg_needs_the_negative_embeddings():
    assert validate(args()) == []
    assert validate(args(diffusion_nft_kl_beta=0.1)) == [
        "--diffusion-nft-kl-beta > 0 needs a reference: --ref-mode lora_base or ema"
    ]
    assert validate(args(diffusion_nft_kl_beta=0.1, ref_mode="ema")) == []
    assert validate(args(diffusion_nft_guidance_scale=4.5)) == [
        "--diffusion-nft-guidance-scale > 1 needs --diffusion-guidance-scale > 1 (negative embeddings)"
    ]
    assert validate(args(diffusion_nft_guidance_scale=4.5, diffusion_guidance_scale=4.5)) == []


def test_the_actor_holds_the_old_policy_shadow_and_samples_ode_cfg_free():
    assert ALGORITHM.role("actor").frozen_networks == (OLD_POLICY,) and OLD_POLICY.source == "shadow"
    assert not ALGORITHM.samples_sde and not ALGORITHM.log_prob_ratio and ALGORITHM.guidance_scale == 1.0
    assert ALGORITHM.guidance_flags == ("diffusion_nft_guidance_scale",)
    ranges = ALGORITHM.flag_ranges
    assert not ranges["diffusion_nft_timestep_fraction"].contains(0.0)
    assert ranges["diffusion_nft_timestep_fraction"].contains(1.0)
    assert not ranges["diffusion_nft_old_decay_max"].contains(1.5)
