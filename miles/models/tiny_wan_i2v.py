"""Tiny Wan image-to-video pipelines (`WanImageToVideoPipeline`) built offline from configs: tiny_wan's UMT5, VAE
and transformer pieces, the transformer taking the condition channels (2C + 4 in). Wan 2.1 I2V's layout adds an image
branch and a tiny CLIPVisionModel with its CLIPImageProcessor (32x32 crops, PIL backend: no torchvision, no hub
download); Wan 2.2 I2V-A14B's has no image encoder and two experts split at a boundary ratio.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

from miles.models.base import strip_name_or_path
from miles.models.diffusers_family import write_run_defaults
from miles.models.tiny import _t5_encoder, build_t5_tokenizer
from miles.models.tiny_wan import (
    SCHEDULER_SHIFT,
    TINY_WAN_BOUNDARY_RATIO,
    TINY_WAN_LATENT_CHANNELS,
    TINY_WAN_NUM_FRAMES,
    TINY_WAN_RESOLUTION,
    calibrate_tiny_wan_vae,
    tiny_wan_transformer,
    tiny_wan_vae,
)
from miles.models.wan_folder import WAN_MAX_SEQUENCE_LENGTH

logger = logging.getLogger(__name__)

TINY_CLIP_VISION_WIDTH = 16  # the image embeddings' width (Wan 2.1 I2V: ViT-H/14's 1280)
TINY_CLIP_IMAGE_SIZE = 32  # CLIP's crop; 8x8 patches: 17 image tokens (Wan 2.1 I2V: 224 and 257)
# OpenAI CLIP's normalisation, which Wan 2.1 I2V's image processor uses
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def tiny_clip_vision() -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    """A 2-layer CLIP vision tower (the pipeline reads its penultimate hidden states) and its image processor."""
    config = CLIPVisionConfig(
        hidden_size=TINY_CLIP_VISION_WIDTH,
        intermediate_size=2 * TINY_CLIP_VISION_WIDTH,
        projection_dim=TINY_CLIP_VISION_WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=TINY_CLIP_IMAGE_SIZE,
        patch_size=8,
    )
    processor = CLIPImageProcessor(
        size={"shortest_edge": TINY_CLIP_IMAGE_SIZE},
        crop_size={"height": TINY_CLIP_IMAGE_SIZE, "width": TINY_CLIP_IMAGE_SIZE},
        image_mean=list(_CLIP_MEAN),
        image_std=list(_CLIP_STD),
    )
    return CLIPVisionModel(config), processor


def build_tiny_wan_i2v_pipeline(seed: int = 0, *, two_experts: bool = False) -> WanImageToVideoPipeline:
    """The tiny Wan I2V pipeline in float32, eval mode, seeded random weights: Wan 2.1's layout (CLIP vision image
    branch, one expert), or with `two_experts` Wan 2.2 I2V-A14B's (no image encoder; a `transformer_2` and a
    boundary ratio, tiny_wan's 0.875)."""
    tokenizer = build_t5_tokenizer()
    # the I2V transformer takes the last 512 context tokens as text: prompts are encoded at the pipeline's 512
    tokenizer.model_max_length = WAN_MAX_SEQUENCE_LENGTH
    text_dim = 32
    torch.manual_seed(seed)
    text_encoder = _t5_encoder(tokenizer, text_dim, d_kv=8, config_class=UMT5Config, model_class=UMT5EncoderModel)
    vae = tiny_wan_vae()
    in_channels = 2 * TINY_WAN_LATENT_CHANNELS + vae.config.scale_factor_temporal  # latents, mask, image latents
    image_dim = None if two_experts else TINY_CLIP_VISION_WIDTH
    transformer = tiny_wan_transformer(text_dim, in_channels=in_channels, image_dim=image_dim)
    transformer_2 = tiny_wan_transformer(text_dim, in_channels=in_channels) if two_experts else None
    image_encoder, image_processor = (None, None) if two_experts else tiny_clip_vision()
    calibrate_tiny_wan_vae(vae, TINY_WAN_RESOLUTION, torch.Generator().manual_seed(seed))
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT),
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=TINY_WAN_BOUNDARY_RATIO if two_experts else None,
    )
    for module in (text_encoder, vae, transformer, transformer_2, image_encoder):
        if module is not None:
            module.eval()  # from-config models start in train mode
    return pipe


def save_tiny_wan_i2v_pipeline(path: str, seed: int = 0, *, two_experts: bool = False) -> str:
    """Build the tiny Wan I2V pipeline and write it as a diffusers folder (safetensors); returns `path`."""
    pipe = build_tiny_wan_i2v_pipeline(seed=seed, two_experts=two_experts)
    Path(path).mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path, safe_serialization=True)
    strip_name_or_path(path)
    write_run_defaults(path, resolution=TINY_WAN_RESOLUTION, num_frames=TINY_WAN_NUM_FRAMES)  # its toy sizes
    layout = "Wan 2.2 I2V, two experts" if two_experts else "Wan 2.1 I2V"
    logger.info("wrote tiny Wan image-to-video pipeline (%s, seed %d) to %s", layout, seed, path)
    return path
