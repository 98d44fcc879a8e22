"""What the Qwen-Image pipelines (text-to-image `QwenImagePipeline`, `QwenImageEditPipeline`) compute alike, shared
by the qwen-image and qwen-image-edit families (as both share `DiffusersFamily` and packing): the guidance-embedding
refusal, the VAE's scale factor and per-channel scaling, the resolution shift mu, true CFG with its norm rescale, and
the trim of prompt padding."""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from torch import nn

from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import channel_stats, posterior_latents, unit_range
from miles.models.media import Media


def check_no_guidance_embeds(model: nn.Module, path: str, pipeline: str) -> None:
    """Refuse a guidance-distilled QwenImageTransformer2DModel (`guidance_embeds`): `pipeline` cannot run it either
    (its timestep embedding takes no guidance)."""
    if model.config.get("guidance_embeds", False):
        raise ValueError(
            f"{path}: this QwenImageTransformer2DModel has guidance_embeds=True, which {pipeline} does not run "
            "(its timestep embedding takes no guidance); not supported"
        )


def qwen_vae_scale_factor(vae_config: dict[str, Any]) -> int:
    """2 ** len(temperal_downsample), as the Qwen-Image pipelines compute it (8 for Qwen-Image)."""
    return 2 ** len(vae_config["temperal_downsample"])


def _latents_stats(vae: nn.Module, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The config's per-channel latents_mean and 1 / latents_std, shaped (1, C, 1, 1, 1) as the pipelines have them."""
    mean, std = channel_stats(vae, like)
    return mean, 1.0 / std


@torch.no_grad()
def encode_qwen_latents(vae: nn.Module, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Normalized latents (B, C, H, W) = (z - latents_mean) / latents_std of images (B, 3, H, W) in [-1, 1], encoded
    as one frame (the Qwen-Image pipelines' `_encode_vae_image`). z is the posterior mode without a generator, a
    posterior sample drawn with it otherwise. float32."""
    z = posterior_latents(vae, images.to(device=vae.device, dtype=vae.dtype).unsqueeze(2), generator)
    mean, inv_std = _latents_stats(vae, z)
    return ((z - mean) * inv_std)[:, :, 0].float()


@torch.no_grad()
def decode_qwen_latents(vae: nn.Module, x0: torch.Tensor) -> Media:
    """Images (B, 3, H, W) in [0, 1], float32, from normalized latents, as the Qwen-Image pipelines decode them:
    z = x0 / (1 / latents_std) + latents_mean, decoded as one frame."""
    z = x0.to(device=vae.device, dtype=vae.dtype).unsqueeze(2)
    mean, inv_std = _latents_stats(vae, z)
    return Media(unit_range(vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]))


def qwen_mu(scheduler_config: dict[str, Any], latent_height: int, latent_width: int) -> float:
    """The Qwen-Image pipelines' resolution-dependent shift: `calculate_shift` of the generated image's packed
    sequence length (its 2 x 2 patches; an editing pipeline's reference tokens do not count)."""
    return calculate_shift(
        (latent_height // 2) * (latent_width // 2),
        scheduler_config.get("base_image_seq_len", 256),
        scheduler_config.get("max_image_seq_len", 4096),
        scheduler_config.get("base_shift", 0.5),
        scheduler_config.get("max_shift", 1.15),
    )


def true_cfg(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """The Qwen-Image pipelines' true CFG of packed predictions (B, L, 4C): comb = uncond + w * (cond - uncond),
    rescaled by ||cond|| / ||comb|| over each token's channels."""
    comb = uncond + scale * (cond - uncond)
    return comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


def trim_prompt_padding(cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`prompt_embeds` and `prompt_embeds_mask` without the trailing columns that are padding in every row; the mask
    is None when no padding is left (what QwenImagePipeline.encode_prompt passes for such a batch)."""
    embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
    valid = mask.bool()
    if bool(valid.all()):
        return embeds, None
    length = int(valid.any(dim=0).nonzero().max()) + 1 if bool(valid.any()) else embeds.shape[1]
    embeds, valid = embeds[:, :length], valid[:, :length]
    return embeds, None if bool(valid.all()) else valid
