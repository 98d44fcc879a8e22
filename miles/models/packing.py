"""2x2 latent patch packing, the token layout of the pipelines that patchify in the pipeline rather than in the
transformer (`FluxPipeline._pack_latents`, `QwenImagePipeline._pack_latents`: the same permutation), and FLUX's position
ids of such a sequence."""

from __future__ import annotations

import torch


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 patches, channels-major within a patch."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack_latents` for latents of `height` x `width` (the pipelines' `_unpack_latents`)."""
    b, _, channels = packed.shape
    patches = packed.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, channels // 4, height, width)


def packed_position_ids(
    height: int, width: int, device: torch.device | str, dtype: torch.dtype, *, first: float = 0.0
) -> torch.Tensor:
    """(height * width, 3) position ids (first, row, column) of a packed sequence of height x width 2x2 patches
    (`FluxPipeline._prepare_latent_image_ids`: first 0; FluxKontextPipeline marks its source image's tokens 1)."""
    ids = torch.zeros(height, width, 3)
    ids[..., 0] = first
    ids[..., 1] = ids[..., 1] + torch.arange(height)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(width)[None, :]
    return ids.reshape(height * width, 3).to(device=device, dtype=dtype)
