"""A tiny HunyuanVideo-1.5-architecture text-to-video pipeline built offline from configs: the real diffusers and
transformers classes (`HunyuanVideo15Transformer3DModel`, `AutoencoderKLHunyuanVideo15`, `Qwen2_5_VLTextModel`, a
ByT5 `T5EncoderModel`) at toy sizes, a byte-level BPE `Qwen2Tokenizer` built in code with a text-only chat template,
and the byte-level `ByT5Tokenizer` (it needs no files).

The Qwen tokenizer knows the words of the pipeline's system message as whole tokens and a run of 8 spaces as one
token, so the chat prefix the pipeline crops (`crop_start`, 108 tokens with the real tokenizer) is exactly as long
here; the shapes words are whole tokens too, any other text falls back to bytes.
"""

from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path
from typing import Any

import torch
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import AutoencoderKLHunyuanVideo15
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15Transformer3DModel
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import HunyuanVideo15Pipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

from miles.models.diffusers_family import write_run_defaults
from miles.models.loading.pretrained import strip_name_or_path
from miles.models.tiny import SHAPES_WORDS, build_qwen2_tokenizer

logger = logging.getLogger(__name__)

TINY_RESOLUTION = 32
TINY_NUM_FRAMES = 5  # 2 latent frames at the VAE's 4x temporal compression
LATENT_CHANNELS = 4  # 32 in HunyuanVideo 1.5
TEXT_WIDTH = 32  # the Qwen2.5-VL hidden size: the transformer's text_embed_dim (3584)
BYT5_WIDTH = 32  # the ByT5 encoder's d_model: text_embed_2_dim (1472)
SCHEDULER_SHIFT = 7.0  # a static shift, as diffusers' own tests of the pipeline configure
GUIDANCE_SCALE = 6.0  # the guider's CFG scale, what the pipeline's __call__ guides with (miles takes its flag's)
# the system message and crop the pipeline's prompt encoder applies (the defaults of its static encoder)
_MLLM_DEFAULTS = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
SYSTEM_MESSAGE: str = _MLLM_DEFAULTS["system_message"].default
CROP_START: int = _MLLM_DEFAULTS["crop_start"].default
EIGHT_SPACES = "\u0120" * 8  # byte-level BPE's spelling of a run of 8 spaces ("Ġ" is the space byte)
# Qwen2.5-VL's chat template for text messages (the real one also lays out images and videos)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_hunyuan_qwen_tokenizer():
    """The tiny Qwen2 tokenizer with the chat template; its chat prefix before a user's prompt is CROP_START tokens."""
    words = ("system", "user", "assistant", *dict.fromkeys(re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE)))
    tokenizer = build_qwen2_tokenizer((*words, EIGHT_SPACES, *SHAPES_WORDS))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 2048  # the pipeline pads every prompt to 1000 + CROP_START tokens
    prefix = f"<|im_start|>system\n{SYSTEM_MESSAGE}<|im_end|>\n<|im_start|>user\n"
    length = len(tokenizer(prefix).input_ids)
    if length != CROP_START:
        raise RuntimeError(f"the tiny tokenizer's chat prefix is {length} tokens, the pipeline crops {CROP_START}")
    return tokenizer


def build_tiny_text_encoders(tokenizer: Any, tokenizer_2: ByT5Tokenizer) -> tuple[Qwen2_5_VLTextModel, T5EncoderModel]:
    """The tiny Qwen2.5-VL text model and ByT5 encoder, random weights from the current torch seed (in that order)."""
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_WIDTH,
            intermediate_size=2 * TEXT_WIDTH,
            num_hidden_layers=3,  # the pipeline reads the third-to-last hidden states
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=BYT5_WIDTH,
            d_kv=8,
            d_ff=2 * BYT5_WIDTH,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            dropout_rate=0.0,
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            use_cache=False,
            pad_token_id=tokenizer_2.pad_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
        )
    )
    return text_encoder, text_encoder_2


def build_tiny_hunyuan_video15_pipeline(seed: int = 0) -> HunyuanVideo15Pipeline:
    """The tiny pipeline in float32, eval mode, seeded random weights."""
    tokenizer = build_hunyuan_qwen_tokenizer()
    tokenizer_2 = ByT5Tokenizer()
    torch.manual_seed(seed)
    text_encoder, text_encoder_2 = build_tiny_text_encoders(tokenizer, tokenizer_2)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=LATENT_CHANNELS,
        block_out_channels=(16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=4,
        downsample_match_channel=False,
        upsample_match_channel=False,
    )
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1,  # noisy latents, condition latents, condition mask
        out_channels=LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        text_embed_dim=TEXT_WIDTH,
        text_embed_2_dim=BYT5_WIDTH,
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),
        target_size=TINY_RESOLUTION,
        task_type="t2v",
    )
    calibrate_vae(vae, torch.Generator().manual_seed(seed))
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
    )
    for module in (text_encoder, text_encoder_2, vae, transformer):
        module.eval()  # from-config models start in train mode
    return pipe


@torch.no_grad()
def calibrate_vae(vae: AutoencoderKLHunyuanVideo15, generator: torch.Generator) -> None:
    """The VAE's scaling_factor (the pipeline's only latent normalization): 1 / std of the posterior modes of smooth
    random clips, so that scaled latents have unit variance."""
    coarse = torch.rand(4, 3, TINY_NUM_FRAMES, 4, 4, generator=generator) * 2 - 1
    size = (TINY_NUM_FRAMES, TINY_RESOLUTION, TINY_RESOLUTION)
    clips = torch.nn.functional.interpolate(coarse, size=size, mode="trilinear")
    latents = torch.cat([vae.encode(clip).latent_dist.mode() for clip in clips.split(1)])  # one clip at a time:
    # the VAE's causal attention mask broadcasts wrongly over a batch of several clips in diffusers 0.42
    vae.register_to_config(scaling_factor=float(1.0 / latents.std().clamp_min(1e-6)))


def save_tiny_hunyuan_video15_pipeline(path: str, seed: int = 0) -> str:
    """Build the tiny pipeline and write it as a diffusers folder (safetensors); returns `path`."""
    pipe = build_tiny_hunyuan_video15_pipeline(seed=seed)
    Path(path).mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path, safe_serialization=True)
    strip_name_or_path(path)
    write_run_defaults(path, resolution=TINY_RESOLUTION, num_frames=TINY_NUM_FRAMES)  # its toy sizes
    logger.info("wrote tiny HunyuanVideo 1.5 pipeline (seed %d) to %s", seed, path)
    return path
