"""A tiny FLUX.2 [klein]-architecture pipeline built offline from configs: the real diffusers/transformers classes
(`Flux2Transformer2DModel`, `AutoencoderKLFlux2`, `Qwen3ForCausalLM`) at toy sizes, a byte-level BPE Qwen2 tokenizer
built in code with a Qwen3-style chat template, saved as a `Flux2KleinPipeline` folder.

The text encoder is 3 layers deep (16 wide) and its folder records `text_encoder_out_layers` (1, 2, 3) as a run
default (`miles_defaults.json`, which diffusers ignores): the family stacks those hidden states, and the pipeline
does when called with them; a real folder has no such default, and both stack the pipeline's (9, 18, 27). The VAE's
batch-norm statistics are calibrated on smooth random images, so normalised latents are about unit variance.
"""

from __future__ import annotations

import logging

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from tokenizers import AddedToken
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

from miles.models.tiny import SHAPES_WORDS, eval_mode, save_tiny_folder
from miles.models.tiny_qwen_image import build_qwen2_tokenizer

logger = logging.getLogger(__name__)

LATENT_CHANNELS = 4  # the VAE's latent channels (32 in FLUX.2); the transformer sees 2x2 patches: 16
VAE_BLOCK_OUT_CHANNELS = (16, 32, 32)  # three blocks: vae_scale_factor 4
TEXT_WIDTH = 16  # the text encoder's hidden size; the transformer's joint_attention_dim is 3x (three layers stacked)
TEXT_LAYERS = 3
TEXT_ENCODER_OUT_LAYERS = (1, 2, 3)  # the hidden states stacked (the pipeline's default, (9, 18, 27), needs 27 layers)
TOKENIZER_MAX_LENGTH = 32  # the family's max_sequence_length (the tokenizer's limit, at most the pipeline's 512)
# Qwen3's chat template, reduced to what Flux2KleinPipeline renders: user turns, the generation prompt and
# enable_thinking=False's empty think block
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
THINK_TOKENS = ("<think>", "</think>")


def build_qwen3_tokenizer() -> Qwen2Tokenizer:
    """The tiny Qwen2 BPE tokenizer (`build_qwen2_tokenizer`: the shapes words whole) with Qwen3's think tokens and
    chat template, padding to at most TOKENIZER_MAX_LENGTH tokens."""
    tokenizer = build_qwen2_tokenizer(("user", "assistant", *SHAPES_WORDS))
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in THINK_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = TOKENIZER_MAX_LENGTH
    return tokenizer


def build_qwen3_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen3ForCausalLM:
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_WIDTH,
        intermediate_size=2 * TEXT_WIDTH,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=512,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def build_flux2_vae(resolution: int) -> AutoencoderKLFlux2:
    n = len(VAE_BLOCK_OUT_CHANNELS)
    return AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=VAE_BLOCK_OUT_CHANNELS,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=resolution,
    )


@torch.no_grad()
def calibrate_flux2_vae(vae: AutoencoderKLFlux2, resolution: int, generator: torch.Generator) -> None:
    """The batch-norm running mean and variance (FLUX.2's latent normalisation, over the 2x2-patchified channels)
    of smooth random images' posterior modes, so that normalised latents are zero-mean, unit-variance per channel."""
    coarse = torch.rand(16, 3, 4, 4, generator=generator) * 2 - 1
    images = torch.nn.functional.interpolate(coarse, size=(resolution, resolution), mode="bilinear")
    z = vae.encode(images).latent_dist.mode()
    b, c, h, w = z.shape
    patches = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
    per_channel = patches.transpose(0, 1).reshape(c * 4, -1)
    vae.bn.running_mean.copy_(per_channel.mean(dim=1))
    vae.bn.running_var.copy_(per_channel.var(dim=1).clamp_min(1e-4))


def build_tiny_flux2_klein_pipeline(seed: int = 0, resolution: int = 64, *, distilled: bool = False):
    """The tiny FLUX.2 [klein] pipeline in float32, eval mode, seeded random weights; `distilled` is the step-wise
    distilled layout (`is_distilled`: the pipeline runs no CFG), else klein-base's (true CFG for w > 1)."""
    vae_factor = 2 ** (len(VAE_BLOCK_OUT_CHANNELS) - 1)
    if resolution % (2 * vae_factor) != 0:
        raise ValueError(f"resolution {resolution} must be a multiple of {2 * vae_factor} (VAE factor x patchify)")
    tokenizer = build_qwen3_tokenizer()
    torch.manual_seed(seed)
    text_encoder = build_qwen3_text_encoder(tokenizer)
    vae = build_flux2_vae(resolution)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,  # 2x2 patchified latents
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_WIDTH,  # three hidden states stacked
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # (t, h, w, l); sums to the head dim
        guidance_embeds=False,  # klein: no guidance embedding
    )
    calibrate_flux2_vae(vae, resolution, torch.Generator().manual_seed(seed))
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.2's published scheduler config
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )
    pipe = Flux2KleinPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=distilled,
    )
    return eval_mode(pipe)


def save_tiny_flux2_klein_pipeline(path: str, seed: int = 0, resolution: int = 64, *, distilled: bool = False) -> str:
    """Build the tiny FLUX.2 [klein] pipeline and write it as a diffusers folder (safetensors), with the resolution
    it was built for as its run default (the pipeline's is 1024; 64 px is the least a reference image may have,
    `Flux2ImageProcessor.check_image_input`); returns `path`."""
    pipe = build_tiny_flux2_klein_pipeline(seed=seed, resolution=resolution, distilled=distilled)
    save_tiny_folder(pipe, path, resolution=resolution, text_encoder_out_layers=list(TEXT_ENCODER_OUT_LAYERS))
    style = "distilled" if distilled else "base"
    logger.info(
        "wrote tiny FLUX.2 klein (%s) pipeline (seed %d, %dx%d) to %s", style, seed, resolution, resolution, path
    )
    return path
