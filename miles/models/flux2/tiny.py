"""Tiny FLUX.2-architecture pipelines built offline from configs: the real diffusers/transformers classes at toy
sizes, saved as pipeline folders.

FLUX.2 [klein] (`Flux2KleinPipeline`): `Flux2Transformer2DModel` without a guidance embedding, `AutoencoderKLFlux2`,
`Qwen3ForCausalLM` and a byte-level BPE Qwen2 tokenizer built in code with a Qwen3-style chat template.

FLUX.2 [dev] (`Flux2Pipeline`): the transformer with its guidance embedding, the same VAE, a `Mistral3ForConditional
Generation` (3 text layers, a 1-block Pixtral vision tower the pipeline never runs for text prompts) and a byte-level
BPE tokenizer with Mistral's control tokens and a Mistral-Small-3-style chat template (system prompt, user turns of
text and image blocks). The real folder's `tokenizer/` is a `PixtralProcessor`, which transformers cannot build
without torchvision; the tiny folder saves the processor's tokenizer and chat template alone (model_index names the
tokenizer class), which is all `Flux2Pipeline.encode_prompt` uses for text (the flux2-dev family reads a real
folder's the same way: `miles.models.flux2.flux2`). Its tokenizer knows the words of the pipeline's system message whole,
so the system turn is 30 tokens as with a real tokenizer's few dozen, not hundreds of bytes.

The text encoder is 3 layers deep (16 wide) and its folder records `text_encoder_out_layers` (1, 2, 3) as a run
default (`miles_defaults.json`, which diffusers ignores): the family stacks those hidden states, and the pipeline
does when called with them; a real folder has no such default, and both stack the pipeline's (9, 18, 27). The VAE's
batch-norm statistics are calibrated on smooth random images, so normalised latents are about unit variance.
"""

from __future__ import annotations

import functools
import logging

import torch
from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from miles.models.tiny import (
    SHAPES_WORDS,
    build_qwen2_tokenizer,
    bytes_to_unicode,
    eval_mode,
    learn_bpe_merges,
    save_tiny_folder,
    token_id,
)

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
# FLUX.2 [dev]: Mistral's control tokens, the tokenizer's limit (the system turn is 30 tokens, a prompt the rest)
MISTRAL_SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
    "[IMG_BREAK]", "[IMG_END]",
)  # fmt: skip
MISTRAL_MAX_LENGTH = 64
# Mistral-Small-3's chat template, reduced to what Flux2Pipeline renders (format_input: a system turn, user turns of
# text blocks, and image blocks for its prompt upsampling), no generation prompt
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'][0]['text'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- for message in loop_messages %}{{- '[INST]' }}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}{%- endfor %}"
    "{{- '[/INST]' }}{%- endfor %}"
)


def build_qwen3_tokenizer() -> Qwen2Tokenizer:
    """The tiny Qwen2 BPE tokenizer (`build_qwen2_tokenizer`: the shapes words whole) with Qwen3's think tokens and
    chat template, padding to at most TOKENIZER_MAX_LENGTH tokens."""
    tokenizer = build_qwen2_tokenizer(("user", "assistant", *SHAPES_WORDS))
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in THINK_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = TOKENIZER_MAX_LENGTH
    return tokenizer


def build_qwen3_text_encoder(tokenizer: Qwen2Tokenizer) -> Qwen3ForCausalLM:
    ids = functools.partial(token_id, tokenizer)
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
    running_mean, running_var = vae.bn.running_mean, vae.bn.running_var
    assert running_mean is not None and running_var is not None  # the VAE's BatchNorm tracks running statistics
    running_mean.copy_(per_channel.mean(dim=1))
    running_var.copy_(per_channel.var(dim=1).clamp_min(1e-4))


def build_mistral_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every byte a symbol, so any text tokenizes) with Mistral's control tokens, the
    words of Flux2Pipeline's system message and the shapes words each one token, and MISTRAL_CHAT_TEMPLATE."""
    byte_chars = bytes_to_unicode()
    space = byte_chars[ord(" ")]
    vocab = {token: i for i, token in enumerate(MISTRAL_SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab.setdefault(ch, len(vocab))
    words = (*SYSTEM_MESSAGE.replace(",", " ").replace(".", " ").split(), *SHAPES_WORDS)
    merges = learn_bpe_merges(tuple(w for word in words for w in (word, space + word)), end_of_word="")
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in MISTRAL_SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MISTRAL_MAX_LENGTH,
    )
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def build_mistral3_text_encoder(tokenizer: PreTrainedTokenizerFast) -> Mistral3ForConditionalGeneration:
    """A Mistral3 of TEXT_LAYERS layers, TEXT_WIDTH wide (TEXT_ENCODER_OUT_LAYERS stacked, as klein's), with a 1-block Pixtral vision tower (the model
    class has one; Flux2Pipeline reads it only for its prompt upsampling)."""
    ids = functools.partial(token_id, tokenizer)
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_WIDTH,
            "intermediate_size": 2 * TEXT_WIDTH,
            "num_hidden_layers": TEXT_LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "max_position_embeddings": 512,
            "sliding_window": None,
            "bos_token_id": ids("<s>"),
            "eos_token_id": ids("</s>"),
            "pad_token_id": ids("<pad>"),
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": TEXT_WIDTH,
            "intermediate_size": 2 * TEXT_WIDTH,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "image_size": 64,
            "patch_size": 8,
        },
        image_token_index=ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    return Mistral3ForConditionalGeneration(config)


def build_flux2_transformer(*, guidance_embeds: bool) -> Flux2Transformer2DModel:
    """The tiny transformer: one double- and one single-stream block over 2x2-patchified latents and three stacked
    TEXT_WIDTH hidden states; `guidance_embeds`: FLUX.2 [dev]'s guidance embedding (klein has none)."""
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,  # 2x2 patchified latents
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_WIDTH,  # three hidden states stacked
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # (t, h, w, l); sums to the head dim
        guidance_embeds=guidance_embeds,
    )


def flux2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """FLUX.2's published scheduler config (klein's and dev's)."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )


def check_resolution(resolution: int) -> None:
    vae_factor = 2 ** (len(VAE_BLOCK_OUT_CHANNELS) - 1)
    if resolution % (2 * vae_factor) != 0:
        raise ValueError(f"resolution {resolution} must be a multiple of {2 * vae_factor} (VAE factor x patchify)")


def build_tiny_flux2_klein_pipeline(seed: int = 0, resolution: int = 64, *, distilled: bool = False):
    """The tiny FLUX.2 [klein] pipeline in float32, eval mode, seeded random weights; `distilled` is the step-wise
    distilled layout (`is_distilled`: the pipeline runs no CFG), else klein-base's (true CFG for w > 1)."""
    check_resolution(resolution)
    tokenizer = build_qwen3_tokenizer()
    torch.manual_seed(seed)
    text_encoder = build_qwen3_text_encoder(tokenizer)
    vae = build_flux2_vae(resolution)
    transformer = build_flux2_transformer(guidance_embeds=False)  # klein: no guidance embedding
    calibrate_flux2_vae(vae, resolution, torch.Generator().manual_seed(seed))
    pipe = Flux2KleinPipeline(
        # diffusers annotates the scheduler with its top-level name, which mypy reads as the dummy class
        scheduler=flux2_scheduler(),  # type: ignore[arg-type]
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


def build_tiny_flux2_dev_pipeline(seed: int = 0, resolution: int = 64) -> Flux2Pipeline:
    """The tiny FLUX.2 [dev] pipeline in float32, eval mode, seeded random weights: the guidance-embedding
    transformer, a Mistral3 text encoder and its tokenizer (`build_mistral_tokenizer`) as the pipeline's
    `tokenizer`."""
    check_resolution(resolution)
    tokenizer = build_mistral_tokenizer()
    torch.manual_seed(seed)
    text_encoder = build_mistral3_text_encoder(tokenizer)
    vae = build_flux2_vae(resolution)
    transformer = build_flux2_transformer(guidance_embeds=True)
    calibrate_flux2_vae(vae, resolution, torch.Generator().manual_seed(seed))
    pipe = Flux2Pipeline(
        # diffusers annotates the scheduler with its top-level name, which mypy reads as the dummy class
        scheduler=flux2_scheduler(),  # type: ignore[arg-type]
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,  # type: ignore[arg-type]  # annotated AutoProcessor, the class that loads this tokenizer
        transformer=transformer,
    )
    return eval_mode(pipe)


def save_tiny_flux2_dev_pipeline(path: str, seed: int = 0, resolution: int = 64) -> str:
    """Build the tiny FLUX.2 [dev] pipeline and write it as a diffusers folder (safetensors), with the resolution it
    was built for and its hidden states (1, 2, 3) as run defaults (the pipeline's are 1024 px and (10, 20, 30));
    returns `path`."""
    pipe = build_tiny_flux2_dev_pipeline(seed=seed, resolution=resolution)
    save_tiny_folder(pipe, path, resolution=resolution, text_encoder_out_layers=list(TEXT_ENCODER_OUT_LAYERS))
    logger.info("wrote tiny FLUX.2 dev pipeline (seed %d, %dx%d) to %s", seed, resolution, resolution, path)
    return path
