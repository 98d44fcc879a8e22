"""Tiny Wan image-to-video pipelines (`WanImageToVideoPipeline`) built offline from configs: `wan/tiny.py`'s UMT5, VAE
and transformer pieces, the transformer taking the condition channels (2C + 4 in). Wan 2.1 I2V's layout adds an image
branch and a tiny CLIPVisionModel with its CLIPImageProcessor (32x32 crops, PIL backend: no torchvision, no hub
download); Wan 2.2 I2V-A14B's has no image encoder and two experts split at a boundary ratio.
"""

from __future__ import annotations

import logging

from diffusers import WanImageToVideoPipeline
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from miles.models.tiny import build_t5_tokenizer, eval_mode, save_tiny_folder
from miles.models.wan.folder import WAN_MAX_SEQUENCE_LENGTH
from miles.models.wan.tiny import (
    TINY_WAN_LATENT_CHANNELS,
    TINY_WAN_NUM_FRAMES,
    TINY_WAN_RESOLUTION,
    TINY_WAN_TEMPORAL_FACTOR,
    tiny_wan_components,
)

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
    boundary ratio, `wan/tiny.py`'s 0.875)."""
    tokenizer = build_t5_tokenizer()
    # the I2V transformer takes the last 512 context tokens as text: prompts are encoded at the pipeline's 512
    tokenizer.model_max_length = WAN_MAX_SEQUENCE_LENGTH
    components = tiny_wan_components(
        tokenizer,
        seed,
        two_experts=two_experts,
        in_channels=2 * TINY_WAN_LATENT_CHANNELS + TINY_WAN_TEMPORAL_FACTOR,  # latents, mask, image latents
        image_dim=None if two_experts else TINY_CLIP_VISION_WIDTH,
    )
    image_encoder, image_processor = (None, None) if two_experts else tiny_clip_vision()
    pipe = WanImageToVideoPipeline(**components, image_processor=image_processor, image_encoder=image_encoder)
    return eval_mode(pipe)


def save_tiny_wan_i2v_pipeline(path: str, seed: int = 0, *, two_experts: bool = False) -> str:
    """Build the tiny Wan I2V pipeline and write it as a diffusers folder (safetensors); returns `path`."""
    pipe = build_tiny_wan_i2v_pipeline(seed=seed, two_experts=two_experts)
    save_tiny_folder(pipe, path, resolution=TINY_WAN_RESOLUTION, num_frames=TINY_WAN_NUM_FRAMES)  # its toy sizes
    layout = "Wan 2.2 I2V, two experts" if two_experts else "Wan 2.1 I2V"
    logger.info("wrote tiny Wan image-to-video pipeline (%s, seed %d) to %s", layout, seed, path)
    return path
