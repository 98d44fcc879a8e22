"""A tiny Z-Image-architecture pipeline built offline from configs: the real diffusers/transformers classes
(`ZImageTransformer2DModel`, `AutoencoderKL`, `Qwen3Model`) at toy sizes, a byte-level BPE `Qwen2Tokenizer` built in
code with Qwen3's chat template, and Z-Image-Turbo's scheduler (static shift 3).

`ZImagePipeline` renders each prompt through the tokenizer's chat template (`enable_thinking=True`: no empty think
block) and reads the text encoder's second-to-last hidden states, so the template's words are whole tokens here and
the encoder has three layers (the states read are a middle layer's, as in the real 36-layer Qwen3-4B).
"""

from __future__ import annotations

import functools
import logging

import torch
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from tokenizers import AddedToken
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

from miles.models.tiny import (
    LATENT_CHANNELS,
    SHAPES_WORDS,
    build_qwen2_tokenizer,
    build_vae,
    calibrate_vae,
    eval_mode,
    save_tiny_folder,
    token_id,
)

logger = logging.getLogger(__name__)

TEXT_WIDTH = 32  # the text encoder's hidden size: the transformer's cap_feat_dim (2560 in Z-Image, Qwen3-4B's)
MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline's default: every prompt is padded to it before the encoder

# Qwen3's chat template for plain messages (the real one also handles tools and earlier turns' reasoning): each
# message between <|im_start|> and <|im_end|>, then the assistant header and, with enable_thinking false, an empty
# think block (ZImagePipeline passes enable_thinking=True: no think block)
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
CHAT_WORDS = ("system", "user", "assistant")
THINK_TOKENS = ("<think>", "</think>")  # added tokens of Qwen3's tokenizer, not special ones


def build_qwen3_tokenizer() -> Qwen2Tokenizer:
    """Qwen3's tokenizer layout: the byte-level BPE of `build_qwen2_tokenizer` over the chat roles and the shapes
    words, its chat and vision special tokens, the think tokens, and Qwen3's chat template."""
    tokenizer = build_qwen2_tokenizer(CHAT_WORDS + SHAPES_WORDS)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    tokenizer.model_max_length = MAX_SEQUENCE_LENGTH
    return tokenizer


def build_qwen3_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen3Model:
    """A 3-layer Qwen3 (the base model without a language-model head, as Z-Image's `text_encoder`)."""
    ids = functools.partial(token_id, tokenizer)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_WIDTH,
        intermediate_size=2 * TEXT_WIDTH,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    return Qwen3Model(config)


def build_z_image_transformer() -> ZImageTransformer2DModel:
    """A ZImageTransformer2DModel of 2 main layers and 1 refiner layer per stream over the tiny VAE's latents (2x2
    patches) and the tiny text encoder's width; 2 heads of 16 channels, RoPE over (caption/frame, row, column)."""
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=LATENT_CHANNELS,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        qk_norm=True,
        cap_feat_dim=TEXT_WIDTH,
        axes_dims=[4, 6, 6],  # sums to the head dim
        axes_lens=[1024, 128, 128],  # the caption axis holds up to 512 tokens padded to 32, then the image's frame
    )


def z_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Z-Image-Turbo's published scheduler config: flow matching with a static shift of 3 (no dynamic shifting)."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, use_dynamic_shifting=False, shift=3.0)


def build_tiny_z_image_pipeline(seed: int = 0, resolution: int = 32) -> ZImagePipeline:
    """The tiny Z-Image pipeline in float32, eval mode, seeded random weights; its AutoencoderKL (vae_scale_factor 4)
    calibrated at `resolution` (shift and scale, as FLUX.1's VAE that Z-Image uses has them)."""
    if resolution % 8 != 0:
        raise ValueError(f"resolution {resolution} must be a multiple of 8 (VAE factor 4 x 2x2 patches)")
    tokenizer = build_qwen3_tokenizer()
    torch.manual_seed(seed)
    text_encoder = build_qwen3_text_encoder(tokenizer)
    vae = build_vae(resolution)
    transformer = build_z_image_transformer()
    shift, scale = calibrate_vae(vae, resolution, torch.Generator().manual_seed(seed))
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    pipe = ZImagePipeline(
        # diffusers annotates the scheduler with its top-level name, which mypy reads as the dummy class
        scheduler=z_image_scheduler(),  # type: ignore[arg-type]
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,  # type: ignore[arg-type]  # annotated AutoTokenizer, the class that builds this one
        transformer=transformer,
    )
    return eval_mode(pipe)


def save_tiny_z_image_pipeline(path: str, seed: int = 0, resolution: int = 32) -> str:
    """Build the tiny Z-Image pipeline and write it as a diffusers folder (safetensors), with the resolution it was
    built for as its run default (the pipeline's own default is 1024 px); returns `path`."""
    save_tiny_folder(build_tiny_z_image_pipeline(seed=seed, resolution=resolution), path, resolution=resolution)
    logger.info("wrote tiny Z-Image pipeline (seed %d, %dx%d) to %s", seed, resolution, resolution, path)
    return path
