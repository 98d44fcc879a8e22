"""How the family contract suite reads each family's own diffusers pipeline: its latents in the family's layout
(packed, patchified, joint video and audio), its __call__ kwargs for the tiny folders, and the pipeline constants a
tiny folder overrides (Qwen-Image-Edit's reference areas). Used by `family_cases.py`."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any


def same_layout(pipe: Any, latents: Any, resolution: int) -> Any:
    return latents


def flux_unpacked(pipe: Any, latents: Any, resolution: int) -> Any:
    return pipe._unpack_latents(latents, resolution, resolution, pipe.vae_scale_factor)


def flux2_patchified(pipe: Any, latents: Any, resolution: int) -> Any:
    """Flux2KleinPipeline's latents -> the flux2 family's normalised, patchified (B, 4C, h, w): its loop's packed
    tokens (B, h*w, 4C) as they are, or __call__'s denormalised, unpatchified output (output_type="latent")."""
    import torch

    if latents.ndim == 3:  # the denoising loop's state: tokens in row-major order
        side = resolution // (pipe.vae_scale_factor * 2)
        return latents.transpose(1, 2).reshape(latents.shape[0], -1, side, side)
    patches = pipe._patchify_latents(latents)
    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    return (patches - mean) / std


# the tiny FLUX.2 folder's text length and hidden states (its miles_defaults.json; the pipeline's are 512, (9, 18, 27))
FLUX2_CALL_KWARGS = {"max_sequence_length": 32, "text_encoder_out_layers": (1, 2, 3)}
# the tiny FLUX.2 [dev] folder's (the pipeline's are 512, (10, 20, 30)): its system turn is 30 of the 64 tokens
FLUX2_DEV_CALL_KWARGS = {"max_sequence_length": 64, "text_encoder_out_layers": (1, 2, 3)}


def qwen_image_unpacked(pipe: Any, latents: Any, resolution: int) -> Any:
    return pipe._unpack_latents(latents, resolution, resolution, pipe.vae_scale_factor)[:, :, 0]  # one frame


@contextlib.contextmanager
def qwen_edit_reference_area(path: str) -> Iterator[None]:
    """The editing pipelines' __call__ resizing the source images to the areas the tiny folder records (the family
    reads them there; the pipelines hard-code them, one megapixel for the VAE: seconds per image on a CPU):
    QwenImageEditPipeline's `calculate_dimensions` is given the reference area instead of 1024 * 1024, and
    QwenImageEditPlusPipeline's VAE_IMAGE_SIZE and CONDITION_IMAGE_SIZE (its VL images, 384²) are the folder's."""
    from unittest import mock

    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    with open(os.path.join(path, "miles_defaults.json")) as f:
        areas = json.load(f)
    original = pipeline_qwenimage_edit.calculate_dimensions

    def at_folder_area(target_area: int, ratio: float) -> Any:
        assert target_area == 1024 * 1024, target_area  # the pipeline's constant, replaced
        return original(areas["reference_area"], ratio)

    assert (plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE) == (1024 * 1024, 384 * 384)  # the constants replaced
    with (
        mock.patch.object(pipeline_qwenimage_edit, "calculate_dimensions", at_folder_area),
        mock.patch.object(plus, "VAE_IMAGE_SIZE", areas["reference_area"]),
        mock.patch.object(plus, "CONDITION_IMAGE_SIZE", areas.get("condition_area", plus.CONDITION_IMAGE_SIZE)),
    ):
        yield


def ltx2_joint(pipe: Any, latents: Any, resolution: int, num_frames: int = 121) -> Any:
    """LTX2Pipeline's (video, audio) latents -> the ltx2 family's joint (B, D) latent: the loop's packed, normalized
    latents (what its schedulers step) or __call__'s unpacked, denormalized output (output_type="latent")."""
    import torch

    video, audio = latents
    mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
    if video.ndim == 3:  # the denoising loop's state
        frames = (num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
        side = resolution // pipe.vae_spatial_compression_ratio
        patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        video = pipe._unpack_latents(video, frames, side, side, patch, patch_t)
        audio = pipe._unpack_audio_latents(audio, audio.shape[1], num_mel_bins=mel_bins)
    else:  # __call__'s output
        video = pipe._normalize_latents(
            video, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor
        )
        tokens = pipe._normalize_audio_latents(
            pipe._pack_audio_latents(audio), pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std
        )
        audio = pipe._unpack_audio_latents(tokens, audio.shape[2], num_mel_bins=mel_bins)
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)
