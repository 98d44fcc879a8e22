"""The two streams of LTX-2's joint latent as LTX2Pipeline computes them: the token layouts of the video and the audio
latents (`pack_video`, `pack_audio` and their inverses), one stream's guided velocity (CFG in x0 space, then guidance
rescale), the joint transformer forward and the video VAE's compression factors."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from miles.models.conditioning import Conditioning

LTX2_GUIDANCE_RESCALE = 0.7  # LTX2Pipeline's guidance_rescale (and audio_guidance_rescale) default


def pack_video(latents: torch.Tensor, patch: int, patch_t: int) -> torch.Tensor:
    """(B, C, F, H, W) -> (B, F/pt * H/p * W/p, C*pt*p*p) tokens, the layout of LTX2Pipeline._pack_latents."""
    b, c, f, h, w = latents.shape
    x = latents.reshape(b, c, f // patch_t, patch_t, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, (f // patch_t) * (h // patch) * (w // patch), -1)


def unpack_video(tokens: torch.Tensor, shape: tuple[int, ...], patch: int, patch_t: int) -> torch.Tensor:
    """The inverse of `pack_video` for one sample's latent `shape` (C, F, H, W)."""
    c, f, h, w = shape
    x = tokens.reshape(tokens.shape[0], f // patch_t, h // patch, w // patch, c, patch_t, patch, patch)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(tokens.shape[0], c, f, h, w)


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, L, M) -> (B, L, C*M): LTX2Pipeline._pack_audio_latents without patch sizes (what its __call__ uses)."""
    return latents.transpose(1, 2).flatten(2, 3)


def unpack_audio(tokens: torch.Tensor, mel_bins: int) -> torch.Tensor:
    """The inverse of `pack_audio`: (B, L, C*M) -> (B, C, L, M)."""
    return tokens.unflatten(2, (-1, mel_bins)).transpose(1, 2)


def rescale_guided(guided: torch.Tensor, conditional: torch.Tensor, rescale: float) -> torch.Tensor:
    """Guidance rescale (Lin et al. 2023, §3.4), per sample over all other dims: the guided prediction scaled to the
    conditional one's std, mixed with the unscaled one by `rescale` (what LTX2Pipeline applies to its x0)."""
    dims = list(range(1, guided.ndim))
    scaled = guided * (conditional.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return rescale * scaled + (1 - rescale) * guided


def joint_forward(
    transformer: nn.Module,
    hidden: tuple[torch.Tensor, torch.Tensor],
    cond: Conditioning,
    timestep: torch.Tensor,
    token_grid: tuple[tuple[int, int, int], int],
    fps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the transformer on the (video, audio) `hidden` tokens as LTX2Pipeline's denoising loop calls it
    (no STG, no modality isolation): the two streams' predictions. `token_grid`: the video tokens' (frames, height,
    width) and the audio latent frames."""
    (frames, height, width), audio_frames = token_grid
    return transformer(
        hidden_states=hidden[0],
        audio_hidden_states=hidden[1],
        encoder_hidden_states=cond["prompt_embeds"],
        audio_encoder_hidden_states=cond["audio_prompt_embeds"],
        timestep=timestep,
        sigma=timestep,  # the pipeline passes the scaled timestep as `sigma` too
        encoder_attention_mask=cond["attention_mask"],
        audio_encoder_attention_mask=cond["attention_mask"],
        num_frames=frames,
        height=height,
        width=width,
        fps=fps,
        audio_num_frames=audio_frames,
        isolate_modalities=False,
        spatio_temporal_guidance_blocks=None,
        perturbation_mask=None,
        use_cross_timestep=True,
        return_dict=False,
    )


def guided_stream_velocity(
    sample: torch.Tensor, pred: torch.Tensor, sigma: torch.Tensor, guidance_scale: float, cfg: bool
) -> torch.Tensor:
    """One stream's guided velocity, in LTX2Pipeline's order of operations (x0 space, then back)."""
    delta: torch.Tensor | int  # 0 without CFG
    if cfg:
        uncond, cond = pred.chunk(2)
        x0 = sample - cond * sigma
        delta = (guidance_scale - 1) * (x0 - (sample - uncond * sigma))
    else:
        x0, delta = sample - pred * sigma, 0
    guided = x0 + delta
    x0 = rescale_guided(guided, x0, LTX2_GUIDANCE_RESCALE) if LTX2_GUIDANCE_RESCALE > 0 else guided
    return (sample - x0) / sigma


def vae_factors(config: dict[str, Any]) -> tuple[int, int]:
    """(spatial, temporal) compression of the video VAE of `config` (vae/config.json), computed as
    AutoencoderKLLTX2Video does."""
    scaling = config.get("spatio_temporal_scaling", (True, True, True, True))
    if isinstance(scaling, bool):
        scaling = (scaling,) * (len(config.get("layers_per_block", (4, 6, 6, 2, 2))) - 1)
    spatial = config.get("spatial_compression_ratio") or config.get("patch_size", 4) * 2 ** sum(scaling)
    temporal = config.get("temporal_compression_ratio") or config.get("patch_size_t", 1) * 2 ** sum(scaling)
    return int(spatial), int(temporal)
