"""Tiny Wan 2.x pipelines built offline from configs: the real diffusers/transformers classes (UMT5EncoderModel,
AutoencoderKLWan, WanTransformer3DModel) at toy sizes, with the T5 tokenizer of `miles.models.tiny`.

One expert (Wan 2.1 layout) or two experts split at a boundary ratio (Wan 2.2 A14B layout). The scheduler is the
flow-matching Euler one, which WanPipeline accepts, so miles' ODE sampling can be compared with the pipeline's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

from miles.models.tiny import build_t5_encoder, build_t5_tokenizer, eval_mode, save_tiny_folder

logger = logging.getLogger(__name__)

TINY_WAN_NUM_FRAMES = 5  # two latent frames
TINY_WAN_RESOLUTION = 32  # 4x4 latents, 2x2 patches per latent frame
TINY_WAN_LATENT_CHANNELS = 4
TINY_WAN_TEMPORAL_FACTOR = 4  # the VAE's frames per latent frame (Wan's)
TINY_WAN_BOUNDARY_RATIO = 0.875  # Wan 2.2 A14B's text-to-video boundary
SCHEDULER_SHIFT = 3.0
_TARGET_MEAN = (0.5, -0.5, 0.25, -0.25)  # per-channel statistics the tiny VAE's latents are given
_TARGET_STD = (0.8, 1.2, 1.0, 1.5)


def tiny_wan_vae() -> AutoencoderKLWan:
    """Wan's VAE layout (three downsamples: 8x spatial, 4x temporal) at 8 base channels."""
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=TINY_WAN_LATENT_CHANNELS,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * TINY_WAN_LATENT_CHANNELS,
        latents_std=[1.0] * TINY_WAN_LATENT_CHANNELS,
        scale_factor_temporal=TINY_WAN_TEMPORAL_FACTOR,
        scale_factor_spatial=8,
    )


@torch.no_grad()
def calibrate_tiny_wan_vae(vae: AutoencoderKLWan, resolution: int, generator: torch.Generator) -> None:
    """Make the random VAE's latents of smooth random clips unit-scale and record their per-channel statistics.

    At random init the encoder's means come out ~0.07 wide around offsets of ~0.3: decoding normalized latents
    would then hand the decoder nearly the same input for every sample, and nothing a policy does to its latents
    would show in the pixels. An affine map on the mean half of `quant_conv` makes the raw latents O(1) with
    per-channel offsets and widths (`_TARGET_MEAN`, `_TARGET_STD`), as real Wan latents are; `latents_mean` /
    `latents_std` record what comes out, so the pipeline's per-channel normalization does real work."""
    coarse = torch.rand(8, 3, 2, 4, 4, generator=generator) * 2 - 1
    clips = torch.nn.functional.interpolate(
        coarse, size=(TINY_WAN_NUM_FRAMES, resolution, resolution), mode="trilinear"
    )

    def channel_stats() -> tuple[torch.Tensor, torch.Tensor]:
        latents = vae.encode(clips).latent_dist.mode()  # (8, C, F, h, w)
        per_channel = latents.transpose(0, 1).flatten(1)
        return per_channel.mean(1), per_channel.std(1).clamp_min(1e-6)

    mean, std = channel_stats()
    channels = TINY_WAN_LATENT_CHANNELS
    conv = vae.quant_conv  # (2C -> 2C) 1x1x1: the first C outputs are the posterior means
    target_mean, target_std = torch.tensor(_TARGET_MEAN), torch.tensor(_TARGET_STD)
    conv.weight[:channels] *= (target_std / std).view(channels, 1, 1, 1, 1)
    bias = conv.bias
    assert bias is not None  # diffusers builds quant_conv with a bias
    bias[:channels] = (bias[:channels] - mean) * target_std / std + target_mean
    mean, std = channel_stats()
    vae.register_to_config(
        latents_mean=[round(float(v), 6) for v in mean], latents_std=[round(float(v), 6) for v in std]
    )


def tiny_wan_transformer(
    text_dim: int, *, in_channels: int = TINY_WAN_LATENT_CHANNELS, image_dim: int | None = None
) -> WanTransformer3DModel:
    """Two Wan blocks at width 32; `in_channels` beyond the latent's take conditioning channels (image-to-video),
    `image_dim` adds Wan 2.1 I2V's image branch (image embedder, added key/value projections of that width)."""
    inner = 2 * 16
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,  # rotary split: 8 temporal, 4 + 4 spatial
        in_channels=in_channels,
        out_channels=TINY_WAN_LATENT_CHANNELS,
        image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else inner,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )


def tiny_wan_components(
    tokenizer: T5Tokenizer,
    seed: int,
    *,
    two_experts: bool,
    in_channels: int = TINY_WAN_LATENT_CHANNELS,
    image_dim: int | None = None,
) -> dict[str, Any]:
    """The components every tiny Wan pipeline holds, seeded: `tokenizer`, a UMT5 encoder over it, the calibrated
    VAE, the Euler scheduler, the transformer (`in_channels`, `image_dim`: `tiny_wan_transformer`'s) and, with
    `two_experts`, a low-noise `transformer_2` (its own weights, no image branch) split at boundary ratio 0.875."""
    text_dim = 32
    torch.manual_seed(seed)
    text_encoder = build_t5_encoder(tokenizer, text_dim, d_kv=8, config_class=UMT5Config, model_class=UMT5EncoderModel)
    vae = tiny_wan_vae()
    transformer = tiny_wan_transformer(text_dim, in_channels=in_channels, image_dim=image_dim)
    transformer_2 = tiny_wan_transformer(text_dim, in_channels=in_channels) if two_experts else None
    calibrate_tiny_wan_vae(vae, TINY_WAN_RESOLUTION, torch.Generator().manual_seed(seed))
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT),
        "transformer": transformer,
        "transformer_2": transformer_2,
        "boundary_ratio": TINY_WAN_BOUNDARY_RATIO if two_experts else None,
    }


def build_tiny_wan_pipeline(seed: int = 0, *, two_experts: bool = False) -> WanPipeline:
    """The tiny Wan pipeline in float32, eval mode, seeded random weights; `two_experts` adds a `transformer_2`
    (low-noise expert, its own weights) and `boundary_ratio` 0.875, Wan 2.2 A14B's layout."""
    return eval_mode(WanPipeline(**tiny_wan_components(build_t5_tokenizer(), seed, two_experts=two_experts)))


def save_tiny_wan_pipeline(path: str, seed: int = 0, *, two_experts: bool = False) -> str:
    """Build the tiny Wan pipeline and write it as a diffusers folder (safetensors); returns `path`."""
    pipe = build_tiny_wan_pipeline(seed=seed, two_experts=two_experts)
    save_tiny_folder(pipe, path, resolution=TINY_WAN_RESOLUTION, num_frames=TINY_WAN_NUM_FRAMES)  # its toy sizes
    logger.info(
        "wrote tiny Wan pipeline (%s, seed %d) to %s", "two experts" if two_experts else "one expert", seed, path
    )
    return path
