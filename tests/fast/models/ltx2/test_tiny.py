"""The tiny LTX-2 builder (miles/models/ltx2/tiny.py): a folder whose transformer takes the video latents, the audio
latents packed over their mel bins and the connectors' text, and a Gemma tokenizer in which every shapes-world word
is one token."""

from __future__ import annotations

from miles.models.ltx2.tiny import (
    AUDIO_LATENT_CHANNELS,
    GEMMA_MAX_LENGTH,
    MEL_BINS,
    TEXT_WIDTH,
    TINY_LTX2_RESOLUTION,
    VIDEO_LATENT_CHANNELS,
    build_gemma_tokenizer,
)
from miles.models.tiny import SHAPES_WORDS
from tests.fast.models.tiny_checks import check_tiny_folder


def test_the_folder_fits_its_transformer_to_both_streams_and_the_text(tiny_ltx2_dir):
    configs = check_tiny_folder(tiny_ltx2_dir, "LTX2Pipeline", "ltx2", {"resolution": TINY_LTX2_RESOLUTION})
    transformer = configs["transformer"]
    assert transformer["in_channels"] == transformer["out_channels"] == configs["vae"]["latent_channels"]
    assert transformer["in_channels"] == VIDEO_LATENT_CHANNELS
    packed_audio = AUDIO_LATENT_CHANNELS * MEL_BINS // 4  # the audio VAE compresses mel bins 4x
    assert transformer["audio_in_channels"] == transformer["audio_out_channels"] == packed_audio
    assert configs["audio_vae"]["latent_channels"] == AUDIO_LATENT_CHANNELS
    assert transformer["caption_channels"] == configs["connectors"]["caption_channels"] == TEXT_WIDTH
    assert configs["vocoder"]["in_channels"] == configs["audio_vae"]["output_channels"] * MEL_BINS


def test_every_shapes_word_is_one_gemma_token():
    tokenizer = build_gemma_tokenizer()
    assert tokenizer.model_max_length == GEMMA_MAX_LENGTH
    for word in SHAPES_WORDS:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] != tokenizer.unk_token_id, (word, ids)
