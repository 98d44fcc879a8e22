"""The FLUX.1 family: FluxTransformer2DModel, CLIP (pooled) + T5 text encoders, AutoencoderKL, flow matching with a
resolution-dependent shift. Computed exactly as `diffusers.FluxPipeline` does, from a local pipeline folder; what
every FLUX.1 folder shares (text, VAE, guidance, σ grid, geometry) is `miles.models.flux.folder`'s.

Latent layout: miles holds FLUX latents unpacked, (C, H, W) like SD3's; `predict_velocity` packs them into the
pipeline's 2x2 patch sequence (with its image position ids) and unpacks the velocity. Packing is a permutation, so
Euler steps, SDE log-probs (means over dims), encoding, decoding and rewards need nothing FLUX-specific.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from miles.models.base import compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import check_velocity_inputs
from miles.models.flux.folder import FluxFolderFamily
from miles.models.packing import pack_latents, packed_position_ids, unpack_latents

logger = logging.getLogger(__name__)


@register_train_pipeline_config
class FluxPipelineConfig(FluxFolderFamily):
    """FLUX.1 pipeline folders (`FluxPipeline`): dev-style (guidance-distilled, `guidance_embeds`) and schnell-style.

    Guidance: with a guidance embedding, `guidance_scale` is the embedded value (the pipeline's `guidance_scale`,
    one forward, no negative); without one, `guidance_scale > 1` is the pipeline's true CFG (`true_cfg_scale` with a
    negative prompt). The VAE is AutoencoderKL with FluxPipeline's normalization (scale, then shift).
    """

    name = "flux"
    prompt_cache_exact = True  # T5 and CLIP at fixed lengths: a prompt's rows do not depend on its batch
    pipeline_class_name = "FluxPipeline"
    text_pipeline_class = "FluxPipeline"

    # text
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """`FluxPipeline.encode_prompt(max_sequence_length=...)`: `prompt_embeds` (B, L, D) the T5 sequence,
        `pooled_prompt_embeds` (B, P) CLIP's pooled output (`encode_text`)."""
        return self.encode_text(prompts).to(device=device)

    # the flow
    def predict_velocity(
        self,
        transformer: nn.Module,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: Conditioning,
        *,
        guidance_scale: float = 1.0,
        negative: Conditioning | None = None,
    ) -> torch.Tensor:
        """The velocity (float32, latents' shape (B, C, H, W)) at noise levels `sigmas` (B,), as FluxPipeline's
        denoising loop computes it: the packed latents at their image position ids, through `guided_velocity` (the
        guidance embedding, or true CFG when w > 1 without one). `negative` may be a batch of one (broadcast).
        """
        check_velocity_inputs(latents, sigmas, embeds)
        _, _, height, width = latents.shape
        if height % 2 or width % 2:
            raise ValueError(f"FLUX latents pack 2x2 patches: height and width must be even, got {height}x{width}")
        dtype = compute_dtype(transformer)
        hidden = pack_latents(latents.to(dtype))
        img_ids = packed_position_ids(height // 2, width // 2, latents.device, dtype)
        pred = self.guided_velocity(
            transformer, hidden, img_ids, sigmas, embeds, guidance_scale=guidance_scale, negative=negative
        )
        return unpack_latents(pred, height, width)
