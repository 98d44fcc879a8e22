"""The FLUX.1 Kontext family (image editing): FLUX.1's networks with the source image's VAE latents appended to the
noise tokens, computed exactly as `diffusers.FluxKontextPipeline` does, from a local pipeline folder. What every FLUX.1
folder shares (text, VAE, guidance, σ grid, geometry) is `miles.models.flux.folder`'s.

Latent layout as in the flux family: unpacked (C, H, W); `predict_velocity` packs the noise latents and the source
image's latents into 2x2 patch sequences, joins them, and keeps the noise tokens of the output.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from torch import nn

from miles.models.base import RunAlgorithm, compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import check_velocity_inputs, encode_shift_scaled
from miles.models.flux.folder import FluxFolderFamily
from miles.models.packing import pack_latents, packed_position_ids, unpack_latents

logger = logging.getLogger(__name__)


@register_train_pipeline_config
class FluxKontextPipelineConfig(FluxFolderFamily):
    """FLUX.1 Kontext pipeline folders (`FluxKontextPipeline`): one source image per prompt, edited.

    Conditioning: the prompt's T5 sequence and CLIP pooled output (as FLUX.1's), and `image_latents` (B, C, h, w), the
    source image's VAE posterior mode normalised (z - shift_factor) * scaling_factor, unpacked. In `predict_velocity`
    they are packed and appended after the noise tokens with position ids whose first coordinate is 1; the output's
    noise tokens are the velocity.

    Guidance as the pipeline's: with a guidance embedding (FLUX.1-Kontext-dev), `guidance_scale` is the embedded
    value, one forward; without one, w > 1 is its true CFG (`true_cfg_scale` with a negative prompt), the negative
    text with the same source image. The pipeline can also run true CFG on top of the guidance embedding (two
    scales); miles has one scale, so a --negative-prompt with a guidance-distilled folder is refused at start-up.

    Difference from `FluxKontextPipeline.__call__`: the pipeline resizes the source image to the preferred Kontext
    resolution of its aspect ratio (`_auto_resize`, PREFERRED_KONTEXT_RESOLUTIONS) and generates at `max_area`; miles'
    data loader resizes the source image to the run's --resolution and generates at that size, so this family is the
    pipeline called with `_auto_resize=False`, `height = width = max_area ** 0.5 = resolution` (the image's sides
    rounded down to a multiple of vae_scale_factor * 2, as the pipeline rounds them).
    """

    name = "flux-kontext"
    prompt_cache_exact = True  # FLUX's text rows, and the VAE's mode of each source image
    pipeline_class_name = "FluxKontextPipeline"
    text_pipeline_class = "FluxKontextPipeline"
    source_image_range = (1, 1)  # the pipeline takes one image per prompt

    def check_run_args(self, args: argparse.Namespace, algorithm: RunAlgorithm) -> None:
        """Refused at start-up: a negative prompt the guidance-distilled transformer would not use."""
        if self.guidance_embeds and args.negative_prompt:
            raise ValueError(
                f"--negative-prompt with the guidance-distilled {self.path}: --diffusion-guidance-scale is its "
                "embedded guidance and FluxKontextPipeline's true CFG on top of it (a second scale) is not supported; "
                "drop --negative-prompt"
            )

    # text and source images
    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        device: torch.device | str | None = None,
        *,
        images: list[list[np.ndarray]] | None = None,
    ) -> Conditioning:
        """`FluxKontextPipeline.encode_prompt` (`encode_text`): `prompt_embeds` (B, L, D), `pooled_prompt_embeds`
        (B, P); with `images` (one (H, W, 3) uint8 image per prompt) also `image_latents` (B, C, h, w), float32.
        Without images (a negative prompt): the text only."""
        text = self.encode_text(prompts)
        if images is None:
            return text.to(device=device)
        self.check_source_images(len(prompts), images)
        image_latents = self.encode_source_images([i[0] for i in images]).to(text["prompt_embeds"].device)
        return Conditioning({**text, "image_latents": image_latents}).to(device=device)

    @torch.no_grad()
    def encode_source_images(self, images: list[np.ndarray]) -> torch.Tensor:
        """Normalised VAE latents (B, C, h, w), float32, of (H, W, 3) uint8 images, as the pipeline prepares its
        `image` with `_auto_resize=False`: every image resized (PIL, Lanczos) to the first one's sides rounded down to
        a multiple of vae_scale_factor * 2 (no change at the run's resolution), x / 255 * 2 - 1, the posterior's
        mode, (z - shift_factor) * scaling_factor. One VAE call per image, as the pipeline encodes with a generator
        per prompt: a sample's latents do not depend on its batchmates (a batched call differs by ~1e-5)."""
        multiple = self.vae_scale_factor * 2
        height, width = (side // multiple * multiple for side in images[0].shape[:2])
        processor = VaeImageProcessor(vae_scale_factor=multiple)
        pixels = processor.preprocess([Image.fromarray(image) for image in images], height, width)
        # slices of the processor's channels-last tensor, as the pipeline's: the VAE's kernels follow the layout
        return torch.cat([encode_shift_scaled(self.cached_vae(), pixels[i : i + 1], None) for i in range(len(pixels))])

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
        """The velocity (float32, latents' shape (B, C, H, W)) at noise levels `sigmas` (B,), as the pipeline's loop
        computes it: [noise tokens; source image tokens] with their position ids (first coordinate 0, then 1) through
        `guided_velocity` (true CFG pairs the negative text with each row's source image), the output's noise tokens.
        `negative` (text) may be a batch of one (broadcast).
        """
        check_velocity_inputs(latents, sigmas, embeds)
        if "image_latents" not in embeds:
            raise ValueError(
                f"the {self.name} family needs each prompt's source image latents: encode the prompts with their "
                "source images (encode_prompts(prompts, images=...))"
            )
        _, _, height, width = latents.shape
        source = embeds["image_latents"]
        if height % 2 or width % 2 or source.shape[-2] % 2 or source.shape[-1] % 2:
            raise ValueError(
                f"FLUX latents pack 2x2 patches: height and width must be even, got {height}x{width} (noise) and "
                f"{source.shape[-2]}x{source.shape[-1]} (source image)"
            )
        dtype = compute_dtype(transformer)
        device = latents.device
        noise_tokens = pack_latents(latents.to(dtype))
        hidden = torch.cat([noise_tokens, pack_latents(source.to(device=device, dtype=dtype))], dim=1)
        img_ids = torch.cat(
            [
                packed_position_ids(height // 2, width // 2, device, dtype),
                packed_position_ids(source.shape[-2] // 2, source.shape[-1] // 2, device, dtype, first=1.0),
            ]
        )
        pred = self.guided_velocity(
            transformer,
            hidden,
            img_ids,
            sigmas,
            embeds,
            guidance_scale=guidance_scale,
            negative=negative,
            noise_tokens=noise_tokens.shape[1],
        )
        return unpack_latents(pred, height, width)
