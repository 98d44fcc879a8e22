"""A tiny SD3-architecture pipeline built offline from configs: the real diffusers/transformers classes at toy sizes
(`builtin:tiny-sd3`; scripts/pretrain_tiny_shapes.py builds the shipped `builtin:tiny-shapes` with larger sizes)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from miles.models.tiny import (
    LATENT_CHANNELS,
    SCHEDULER_SHIFT,
    VAE_BLOCK_OUT_CHANNELS,
    build_clip_text_encoder_with_projection,
    build_clip_tokenizer,
    build_t5_encoder,
    build_t5_tokenizer,
    build_vae,
    calibrate_vae,
    eval_mode,
    save_tiny_folder,
)

logger = logging.getLogger(__name__)


CLIP_PROJECTION = 32  # each tiny CLIP's pooled width


def build_tiny_sd3_pipeline(
    seed: int = 0,
    resolution: int = 32,
    *,
    transformer_layers: int = 2,
    transformer_heads: int = 4,
    transformer_head_dim: int = 16,
    vae_block_out_channels: tuple[int, ...] = VAE_BLOCK_OUT_CHANNELS,
    vae_layers_per_block: int = 1,
    qk_norm: str | None = None,
    dual_attention_layers: tuple[int, ...] = (),
) -> StableDiffusion3Pipeline:
    """The tiny SD3 pipeline in float32, eval mode, with seeded random weights (a few MB in all).

    The keyword-only sizes default to the test-tiny model; `scripts/pretrain_tiny_shapes.py` picks larger ones.
    `qk_norm="rms_norm"` with `dual_attention_layers` gives SD3.5's transformer layout (Medium: MMDiT-X).
    """
    vae_factor = 2 ** (len(vae_block_out_channels) - 1)
    if resolution % (2 * vae_factor) != 0:
        raise ValueError(f"resolution {resolution} must be a multiple of {2 * vae_factor} (VAE factor x patch size)")
    tokenizer, tokenizer_2, tokenizer_3 = build_clip_tokenizer(), build_clip_tokenizer(), build_t5_tokenizer()
    clip_widths, t5_width = (32, 32), 64

    torch.manual_seed(seed)
    text_encoder = build_clip_text_encoder_with_projection(tokenizer, clip_widths[0], CLIP_PROJECTION)
    text_encoder_2 = build_clip_text_encoder_with_projection(tokenizer_2, clip_widths[1], CLIP_PROJECTION)
    text_encoder_3 = build_t5_encoder(tokenizer_3, d_model=t5_width)
    vae = build_vae(resolution, vae_block_out_channels, vae_layers_per_block)
    heads, head_dim = transformer_heads, transformer_head_dim
    transformer = SD3Transformer2DModel(
        sample_size=resolution // vae_factor,
        patch_size=2,
        in_channels=LATENT_CHANNELS,
        num_layers=transformer_layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=t5_width,  # CLIP embeddings (32 + 32 wide) are zero-padded to the T5 width
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=2 * CLIP_PROJECTION,  # the two CLIPs' pooled embeddings, concatenated
        out_channels=LATENT_CHANNELS,
        pos_embed_max_size=4 * resolution // vae_factor // 2,  # room for up to 4x the default resolution
        qk_norm=qk_norm,
        dual_attention_layers=dual_attention_layers,
    )
    shift, scale = calibrate_vae(vae, resolution, torch.Generator().manual_seed(seed))
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT)

    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    return eval_mode(pipe)


def save_tiny_sd3_pipeline(path: str, seed: int = 0, resolution: int = 32, **sizes: Any) -> str:
    """Build the tiny pipeline (`sizes`: build_tiny_sd3_pipeline's keywords) and write it as a diffusers folder
    (safetensors); returns `path`."""
    save_tiny_folder(build_tiny_sd3_pipeline(seed=seed, resolution=resolution, **sizes), path)
    logger.info("wrote tiny SD3 pipeline (seed %d, %dx%d) to %s", seed, resolution, resolution, path)
    return path
