"""A tiny FLUX.1-architecture pipeline built offline from configs (the real diffusers/transformers classes at toy
sizes, tokenizers built in code as in `miles.models.tiny`): dev-style (guidance embedding) or schnell-style, as a
`FluxPipeline` or, with the same components, a `FluxKontextPipeline` (FLUX.1 Kontext's folder layout)."""

from __future__ import annotations

import logging

import torch
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import FluxKontextPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from miles.models.tiny import (
    LATENT_CHANNELS,
    VAE_BLOCK_OUT_CHANNELS,
    build_clip_text_encoder,
    build_clip_tokenizer,
    build_t5_encoder,
    build_t5_tokenizer,
    build_vae,
    calibrate_vae,
    eval_mode,
    save_tiny_folder,
)

logger = logging.getLogger(__name__)


def build_tiny_flux_pipeline(
    seed: int = 0, resolution: int = 32, *, guidance_embeds: bool = True, kontext: bool = False
) -> FluxPipeline | FluxKontextPipeline:
    """The tiny FLUX pipeline in float32, eval mode, seeded random weights; `guidance_embeds` True is FLUX.1-dev's
    guidance-distilled layout, False schnell's. The scheduler is FLUX.1's (dynamic, resolution-dependent shift), as
    FLUX.1-Kontext-dev's is too. `kontext`: the same networks in a FluxKontextPipeline (no IP-adapter encoder)."""
    vae_factor = 2 ** (len(VAE_BLOCK_OUT_CHANNELS) - 1)
    if resolution % (2 * vae_factor) != 0:
        raise ValueError(f"resolution {resolution} must be a multiple of {2 * vae_factor} (VAE factor x packing)")
    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    clip_width, t5_width = 32, 64

    torch.manual_seed(seed)
    text_encoder = build_clip_text_encoder(tokenizer, hidden=clip_width)
    text_encoder_2 = build_t5_encoder(tokenizer_2, d_model=t5_width)
    vae = build_vae(resolution)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,  # 2x2 packed latents
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=t5_width,
        pooled_projection_dim=clip_width,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),  # sums to the head dim
    )
    shift, scale = calibrate_vae(vae, resolution, torch.Generator().manual_seed(seed))
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = (FluxKontextPipeline if kontext else FluxPipeline)(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    return eval_mode(pipe)


def save_tiny_flux_pipeline(
    path: str, seed: int = 0, resolution: int = 32, *, guidance_embeds: bool = True, kontext: bool = False
) -> str:
    """Build the tiny FLUX (or FLUX Kontext) pipeline and write it as a diffusers folder (safetensors); returns
    `path`."""
    pipe = build_tiny_flux_pipeline(seed=seed, resolution=resolution, guidance_embeds=guidance_embeds, kontext=kontext)
    save_tiny_folder(pipe, path)
    style = ("Kontext " if kontext else "") + ("dev" if guidance_embeds else "schnell")
    logger.info("wrote tiny FLUX (%s-style) pipeline (seed %d, %dx%d) to %s", style, seed, resolution, resolution, path)
    return path
