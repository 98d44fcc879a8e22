"""The tiny HunyuanVideo 1.5 builder (miles/models/hunyuan_video15/tiny.py): a folder whose transformer takes the
noisy latents with the condition latents and mask, both text encoders' widths and the rotary axes of its head size,
a VAE of 4x spatial and temporal compression, and its toy sizes as run defaults."""

from __future__ import annotations

from miles.models.hunyuan_video15.tiny import LATENT_CHANNELS, TEXT_WIDTH, TINY_NUM_FRAMES, TINY_RESOLUTION
from tests.fast.models.tiny_checks import check_tiny_folder


def test_the_folder_fits_its_transformer_to_its_encoders_and_latents(tiny_hunyuan_video15_dir):
    defaults = {"resolution": TINY_RESOLUTION, "num_frames": TINY_NUM_FRAMES}
    # 17 MiB: diffusers' ByT5 mapper is 2048 wide whatever the model's size (context_embedder_2)
    configs = check_tiny_folder(
        tiny_hunyuan_video15_dir, "HunyuanVideo15Pipeline", "hunyuan-video15", defaults, max_mib=20
    )
    transformer, vae = configs["transformer"], configs["vae"]
    assert transformer["in_channels"] == 2 * LATENT_CHANNELS + 1 == 2 * vae["latent_channels"] + 1
    assert transformer["out_channels"] == LATENT_CHANNELS
    assert transformer["text_embed_dim"] == configs["text_encoder"]["hidden_size"] == TEXT_WIDTH
    assert transformer["text_embed_2_dim"] == configs["text_encoder_2"]["d_model"]  # ByT5's
    assert sum(transformer["rope_axes_dim"]) == transformer["attention_head_dim"]
    assert vae["spatial_compression_ratio"] == vae["temporal_compression_ratio"] == 4
    assert (TINY_NUM_FRAMES - 1) % vae["temporal_compression_ratio"] == 0  # 5 frames: 2 latent frames
