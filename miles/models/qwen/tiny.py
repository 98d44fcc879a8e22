"""A tiny Qwen-Image-architecture pipeline built offline from configs: the real diffusers/transformers classes
(`QwenImageTransformer2DModel`, `AutoencoderKLQwenImage`, `Qwen2_5_VLForConditionalGeneration`) at toy sizes and a
byte-level BPE `Qwen2Tokenizer` built in code.

The tokenizer knows the words of QwenImagePipeline's prompt template as whole tokens, so the template's system part
is the 34 tokens the pipeline drops (`prompt_template_encode_start_idx`), exactly as with the real tokenizer; the
shapes words (`miles.models.tiny.SHAPES_WORDS`) are whole tokens too, any other text falls back to bytes.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from miles.models.tiny import QWEN_ENDOFTEXT, SHAPES_WORDS, build_qwen2_tokenizer, eval_mode, save_tiny_folder, token_id

logger = logging.getLogger(__name__)

LATENT_CHANNELS = 4  # the VAE's z_dim (16 in Qwen-Image)
VAE_DIM_MULT = (1, 2, 2)  # two spatial downsamplings: vae_scale_factor 4
TEXT_WIDTH = 32  # the text encoder's hidden size: the transformer's joint_attention_dim (3584 in Qwen-Image)

# the chat-template words of QwenImagePipeline.prompt_template_encode
TEMPLATE_WORDS: tuple[str, ...] = tuple(
    (
        "system user assistant Describe the image by detailing color shape size texture quantity text spatial "
        "relationships of objects and background"
    ).split()
)


def build_qwen_vl_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    """A 2-layer Qwen2.5-VL, its vision tower 1 block deep (QwenImagePipeline encodes text only; the editing
    pipeline runs the tower on its source image)."""
    ids = functools.partial(token_id, tokenizer)
    heads = 2
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_WIDTH,
            "intermediate_size": 2 * TEXT_WIDTH,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": 1,
            "max_position_embeddings": 1024,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [2, 3, 3],  # sums to head_dim / 2
            },
            "bos_token_id": ids(QWEN_ENDOFTEXT),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids(QWEN_ENDOFTEXT),
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": TEXT_WIDTH,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def build_qwen_image_vae() -> AutoencoderKLQwenImage:
    """Qwen's video VAE at toy sizes (vae_scale_factor 4), latents_mean / std still 0 / 1 (`calibrate_qwen_image_vae`)."""
    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=LATENT_CHANNELS,
        dim_mult=list(VAE_DIM_MULT),
        num_res_blocks=1,
        temperal_downsample=[False, True],  # one entry per downsampling: vae_scale_factor = 2 ** len(...)
        latents_mean=[0.0] * LATENT_CHANNELS,
        latents_std=[1.0] * LATENT_CHANNELS,
    )


@torch.no_grad()
def calibrate_qwen_image_vae(vae: AutoencoderKLQwenImage, resolution: int, generator: torch.Generator) -> None:
    """Per-channel latents_mean / latents_std (Qwen-Image's normalization) of smooth random images, registered
    in the VAE config, so that normalized latents are zero-mean, unit-variance per channel."""
    coarse = torch.rand(16, 3, 4, 4, generator=generator) * 2 - 1
    images = torch.nn.functional.interpolate(coarse, size=(resolution, resolution), mode="bilinear")
    latents = vae.encode(images.unsqueeze(2)).latent_dist.mode()  # (N, C, 1, h, w): one frame
    per_channel = latents.transpose(0, 1).reshape(LATENT_CHANNELS, -1)
    vae.register_to_config(
        latents_mean=[float(m) for m in per_channel.mean(dim=1)],
        latents_std=[float(s) for s in per_channel.std(dim=1).clamp_min(1e-6)],
    )


def build_qwen_image_transformer() -> QwenImageTransformer2DModel:
    """A 2-block QwenImageTransformer2DModel over the tiny VAE's packed latents and the tiny text encoder's width."""
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * LATENT_CHANNELS,  # 2x2 packed latents
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH,
        axes_dims_rope=(4, 6, 6),  # frame, height, width; sums to the head dim
    )


def qwen_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Qwen-Image's published scheduler config: dynamic (exponential) shift mu from 0.5 at 256 packed tokens to 0.9
    at 8192, sigmas stretched to end at 0.02."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def tiny_qwen_image_components(tokenizer: Qwen2Tokenizer, seed: int, resolution: int) -> dict[str, Any]:
    """The components every tiny Qwen-Image pipeline holds, seeded: `tokenizer`, the text encoder over it, the VAE
    calibrated at `resolution` (a multiple of VAE factor x packing), the transformer and Qwen-Image's scheduler."""
    vae_factor = 2 ** (len(VAE_DIM_MULT) - 1)
    if resolution % (2 * vae_factor) != 0:
        raise ValueError(f"resolution {resolution} must be a multiple of {2 * vae_factor} (VAE factor x packing)")
    torch.manual_seed(seed)
    text_encoder = build_qwen_vl_text_encoder(tokenizer)
    vae = build_qwen_image_vae()
    transformer = build_qwen_image_transformer()
    calibrate_qwen_image_vae(vae, resolution, torch.Generator().manual_seed(seed))
    return {
        "scheduler": qwen_image_scheduler(),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
    }


def build_tiny_qwen_image_pipeline(seed: int = 0, resolution: int = 32) -> QwenImagePipeline:
    """The tiny Qwen-Image pipeline in float32, eval mode, seeded random weights, with Qwen-Image's scheduler."""
    return eval_mode(
        QwenImagePipeline(
            **tiny_qwen_image_components(build_qwen2_tokenizer(TEMPLATE_WORDS + SHAPES_WORDS), seed, resolution)
        )
    )


def save_tiny_qwen_image_pipeline(path: str, seed: int = 0, resolution: int = 32) -> str:
    """Build the tiny Qwen-Image pipeline and write it as a diffusers folder (safetensors); returns `path`."""
    # the size it is built for (the pipeline's default: 512 px)
    save_tiny_folder(build_tiny_qwen_image_pipeline(seed=seed, resolution=resolution), path, resolution=resolution)
    logger.info("wrote tiny Qwen-Image pipeline (seed %d, %dx%d) to %s", seed, resolution, resolution, path)
    return path
