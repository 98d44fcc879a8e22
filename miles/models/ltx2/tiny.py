"""A tiny LTX-2-architecture (joint audio-video) pipeline built offline from configs: the real diffusers/transformers
classes at toy sizes (Gemma 3 text encoder with a tokenizer built in code, text connectors, video VAE, audio VAE,
vocoder, the audio-video transformer), seeded random weights, float32, eval mode.

The video VAE compresses 8x in time like LTX-2's and 16x in space (LTX-2: 32x), the audio latents are LTX-2's 25 per
second, so the pipeline's default 121 frames at 24 fps give 16 latent frames of 2x2 at 32 px and 126 audio latent
frames: under 200 transformer tokens in all. The vocoder plays 48 kHz mono (AAC's 1024-sample frames then pad the
mp4's sound by under a video frame).
"""

from __future__ import annotations

import logging
import string

import torch
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import AutoencoderKLLTX2Audio
from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformer3DModel
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer

from miles.models.tiny import SHAPES_WORDS, eval_mode, learn_bpe_merges, save_tiny_folder

logger = logging.getLogger(__name__)

GEMMA_MAX_LENGTH = 32  # the tokenizer's model_max_length: the family's max_sequence_length
TEXT_WIDTH = 32  # Gemma's hidden size = the connectors' width (caption_channels)
TEXT_LAYERS = 2
VIDEO_LATENT_CHANNELS = 8
AUDIO_LATENT_CHANNELS = 2
MEL_BINS = 16  # 4 latent mel bins (the audio VAE compresses mel bins 4x)
AUDIO_SAMPLE_RATE, MEL_HOP_LENGTH = 16000, 160  # 100 mel frames per second, 25 audio latents per second
TINY_LTX2_RESOLUTION = 32  # 2x2 latents per frame: the size it is built for (LTX2Pipeline's default is 512)
VOCODER_RATE = 48000  # 100 mel frames per second x 480 (the vocoder's upsampling) samples


def build_gemma_tokenizer(words: tuple[str, ...] = SHAPES_WORDS) -> GemmaTokenizer:
    """A Gemma BPE tokenizer (byte fallback, so any text tokenizes): printable ASCII characters as symbols and each
    of `words`, with and without its leading "▁" (space), as a single token."""
    vocab: dict[str, int] = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for ch in "▁" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(ch, len(vocab))
    pieces = list(dict.fromkeys([*words, *("▁" + w for w in words)]))
    merges = learn_bpe_merges(tuple(pieces), end_of_word="")  # plain BPE until every piece is one symbol
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    # transformers takes (left, right) merge pairs; its annotation names only "left right" strings
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=GEMMA_MAX_LENGTH)  # type: ignore[arg-type]


def _gemma3(tokenizer: GemmaTokenizer) -> Gemma3ForConditionalGeneration:
    """A 2-layer Gemma 3 (with a 1-layer SigLIP tower the text path never runs)."""
    config = Gemma3Config(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": TEXT_WIDTH,
            "intermediate_size": 2 * TEXT_WIDTH,
            "num_hidden_layers": TEXT_LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 4 * GEMMA_MAX_LENGTH,
            "sliding_window": 8,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
        boi_token_index=len(tokenizer),
        eoi_token_index=len(tokenizer) + 1,
        image_token_index=len(tokenizer) + 2,
    )
    return Gemma3ForConditionalGeneration(config)


def _connectors() -> LTX2TextConnectors:
    """The text connectors: Gemma's hidden states to the video and audio streams' text."""
    return LTX2TextConnectors(
        caption_channels=TEXT_WIDTH,
        text_proj_in_factor=TEXT_LAYERS + 1,  # every hidden state, the embeddings' included
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=TEXT_WIDTH // 2,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=TEXT_WIDTH // 2,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8,
        connector_rope_base_seq_len=GEMMA_MAX_LENGTH,
        rope_double_precision=False,
        rope_type="split",
    )


def _video_vae() -> AutoencoderKLLTX2Video:
    """The video VAE: 16x in space, 8x in time."""
    return AutoencoderKLLTX2Video(
        latent_channels=VIDEO_LATENT_CHANNELS,
        block_out_channels=(8, 8, 8),
        decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        downsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual=(False, False, False),
        upsample_factor=(1, 1, 1),
        patch_size=2,  # 2 x 2^3 = 16x in space (LTX-2: 32x), 2^3 = 8x in time (LTX-2's)
        patch_size_t=1,
        decoder_causal=False,
    )


def _audio_vae() -> AutoencoderKLLTX2Audio:
    """The audio VAE: 25 latents per second, mel bins compressed 4x."""
    return AutoencoderKLLTX2Audio(
        base_channels=AUDIO_LATENT_CHANNELS * MEL_BINS // 4,  # = the packed audio feature width (its statistics)
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=AUDIO_LATENT_CHANNELS,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=AUDIO_SAMPLE_RATE,
        mel_hop_length=MEL_HOP_LENGTH,
        is_causal=True,
        mel_bins=MEL_BINS,
    )


def _vocoder(audio_output_channels: int) -> LTX2Vocoder:
    """The vocoder: mel frames to a 48 kHz mono waveform."""
    return LTX2Vocoder(
        in_channels=audio_output_channels * MEL_BINS,
        hidden_channels=16,
        out_channels=1,
        upsample_kernel_sizes=[16, 12, 20],
        upsample_factors=[8, 6, 10],  # 480 samples per mel frame
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=VOCODER_RATE,
    )


def _transformer() -> LTX2VideoTransformer3DModel:
    """The audio-video transformer."""
    return LTX2VideoTransformer3DModel(
        in_channels=VIDEO_LATENT_CHANNELS,
        out_channels=VIDEO_LATENT_CHANNELS,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        vae_scale_factors=(8, 16, 16),
        audio_in_channels=AUDIO_LATENT_CHANNELS * MEL_BINS // 4,
        audio_out_channels=AUDIO_LATENT_CHANNELS * MEL_BINS // 4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        audio_sampling_rate=AUDIO_SAMPLE_RATE,
        audio_hop_length=MEL_HOP_LENGTH,
        num_layers=2,
        caption_channels=TEXT_WIDTH,
        rope_double_precision=False,
        rope_type="split",
    )


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The pipeline's scheduler config: LTX-2's dynamic shift (mu from the video token count)."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
        time_shift_type="exponential",
    )


def build_tiny_ltx2_pipeline(seed: int = 0) -> LTX2Pipeline:
    """The tiny LTX-2 pipeline in float32, eval mode, with seeded random weights (well under a MB in all)."""
    tokenizer = build_gemma_tokenizer()
    torch.manual_seed(seed)
    text_encoder = _gemma3(tokenizer)
    connectors = _connectors()
    vae = _video_vae()
    audio_vae = _audio_vae()
    vocoder = _vocoder(audio_vae.config["output_channels"])
    transformer = _transformer()
    pipe = LTX2Pipeline(
        # diffusers annotates the scheduler with its top-level name, which mypy reads as the dummy class
        scheduler=_scheduler(),  # type: ignore[arg-type]
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    return eval_mode(pipe)


def save_tiny_ltx2_pipeline(path: str, seed: int = 0) -> str:
    """Build the tiny LTX-2 pipeline and write it as a diffusers folder (safetensors); returns `path`."""
    save_tiny_folder(build_tiny_ltx2_pipeline(seed=seed), path, resolution=TINY_LTX2_RESOLUTION)
    logger.info("wrote tiny LTX-2 pipeline (seed %d) to %s", seed, path)
    return path
