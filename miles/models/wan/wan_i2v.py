"""The Wan image-to-video family (`WanImageToVideoPipeline`): the source image is the clip's first frame. Its VAE
latents (the image followed by zero frames) and a first-frame mask are concatenated to the noisy latents along channels
at every forward, and Wan 2.1 I2V's transformer also cross-attends to CLIP vision embeddings of the image. Wan 2.2
I2V-A14B (no image encoder, two experts) runs the same code with the experts of `miles.models.wan.folder`.

Refused at start-up: Wan 2.2 TI2V-5B's first-frame conditioning (`expand_timesteps`), first-last-frame folders (a
second source image, `last_image`), sequence parallelism, and runs that train on dataset records (sft_loss).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from miles.models.base import register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import channel_stats, check_velocity_inputs, posterior_latents
from miles.models.options import options_of
from miles.models.wan.folder import WAN_MAX_SEQUENCE_LENGTH, WanFolderFamily

logger = logging.getLogger(__name__)


@register_train_pipeline_config
class WanI2VPipelineConfig(WanFolderFamily):
    """Wan 2.1 I2V and Wan 2.2 I2V-A14B pipeline folders (`WanImageToVideoPipeline`): one source image per prompt.

    Conditioning: `prompt_embeds` (B, 512, D) UMT5 states; `condition` (B, 4 + C, F, H, W), the first-frame mask
    (the VAE's temporal factor of channels, 1 on the first latent frame) then the normalized VAE latents of the image
    followed by num_frames - 1 zero frames; `image_embeds` (B, K, D_clip), the CLIP vision tower's penultimate hidden
    states, when the transformer has an image branch (Wan 2.1). The negative is the negative prompt's text alone
    (one row): both CFG branches take the prompt's condition and image embeddings, as the pipeline's do. Options as
    `WanFolderFamily`'s."""

    name = "wan-i2v"
    # not: the VAE's condition latents and CLIP vision embeds of an image differ in the last bits by batch size
    prompt_cache_exact = False
    pipeline_class_name = "WanImageToVideoPipeline"
    options = options_of("wan-i2v")
    source_image_range = (1, 1)
    text_pipeline_class = "WanImageToVideoPipeline"  # its encode_prompt and encode_image (CLIP vision)
    text_modules = ("text_encoder", "image_encoder")

    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)
        if self.expand_timesteps:
            raise ValueError(
                f"{self.path} is a Wan 2.2 TI2V-5B-style folder (expand_timesteps): its image-to-video replaces the "
                "first latent frame by the image latent at every step with per-token timesteps, which the wan-i2v "
                "family does not sample; use it for text-to-video (the wan family, --model-family wan)"
            )
        config = self.cached_json("transformer", "config.json")
        mask_channels = self.vae_scale_factor_temporal
        channels = int(self.cached_json("vae", "config.json")["z_dim"])
        if int(config["in_channels"]) != 2 * channels + mask_channels:
            raise ValueError(
                f"{self.path}/transformer takes {config['in_channels']} input channels, not an image-to-video "
                f"transformer's {2 * channels + mask_channels} (latents, mask and image latents of a {channels}-channel "
                "VAE); a text-to-video Wan folder is the wan family's"
            )
        if config.get("pos_embed_seq_len") is not None:
            raise ValueError(
                f"{self.path} is a first-last-frame (FLF2V) folder (transformer pos_embed_seq_len): it takes a second "
                "source image (`last_image`), which the wan-i2v family does not support (one source image per prompt)"
            )
        self.image_branch = config.get("image_dim") is not None
        index = self.read_json("model_index.json")
        missing = [c for c in ("image_encoder", "image_processor") if (index.get(c) or [None])[0] is None]
        if self.image_branch and missing:
            raise ValueError(
                f"{self.path}: the transformer has an image branch (image_dim) but model_index.json has no "
                f"{' or '.join(missing)} to embed the source image with"
            )

    # text and image
    @property
    def max_sequence_length(self) -> int:
        """UMT5 tokens per prompt: the pipeline's 512, whatever the tokenizer's limit (Wan 2.1 I2V's attention takes
        the last 512 context tokens as the text and those before as the image)."""
        return WAN_MAX_SEQUENCE_LENGTH

    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        device: torch.device | str | None = None,
        *,
        images: list[list[np.ndarray]] | None = None,
    ) -> Conditioning:
        """One row per prompt (class docstring) from each prompt's one source image (H, W, 3) uint8 at the run's
        resolution; without `images`, the text alone (`prompt_embeds`: what the negative branch takes)."""
        text = self.encode_text(prompts, device)
        if images is None:
            return Conditioning({"prompt_embeds": text})
        self.check_source_images(len(prompts), images)
        pixels = [np.asarray(i[0]) for i in images]
        shapes = {p.shape for p in pixels}
        if len(shapes) != 1 or pixels[0].ndim != 3 or pixels[0].shape[2] != 3 or pixels[0].dtype != np.uint8:
            raise ValueError(f"source images must be (H, W, 3) uint8 of one size, got {sorted(shapes)}")
        embeds = {"prompt_embeds": text, "condition": self.condition_latents(pixels).to(device=device)}
        if self.image_branch:
            pipe = self.text_pipeline()
            embeds["image_embeds"] = pipe.encode_image(
                [Image.fromarray(p) for p in pixels], device=pipe.image_encoder.device
            ).to(device=device)
        return Conditioning(embeds)

    def condition_latents(self, pixels: list[np.ndarray]) -> torch.Tensor:
        """(B, 4 + C, F, H, W) float32, as the pipeline's prepare_latents: the first-frame mask, then the normalized
        VAE latents (posterior mode) of each image in [-1, 1] (x / 255 · 2 − 1) followed by num_frames − 1 zero
        frames."""
        vae = self.cached_vae()
        images = torch.from_numpy(np.stack(pixels)).float().div(255.0).mul(2.0).sub(1.0).permute(0, 3, 1, 2)
        batch, _, height, width = images.shape
        video = torch.cat([images[:, :, None], images.new_zeros(batch, 3, self.num_frames - 1, height, width)], dim=2)
        z = posterior_latents(vae, video.to(device=vae.device, dtype=vae.dtype), None).float()
        mean, std = channel_stats(vae, z)
        latents = (z - mean) * std.reciprocal()
        mask = latents.new_zeros(batch, self.vae_scale_factor_temporal, *latents.shape[2:])
        mask[:, :, 0] = 1.0  # the first latent frame is the given image (no last frame)
        return torch.cat([mask, latents], dim=1)

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
        """The velocity (float32, latents' shape (B, C, F, H, W)) at noise levels `sigmas` (B,), as the pipeline's
        loop computes it: the transformer input is the latents then `condition` along channels, with the image
        embeddings beside the text; timesteps σ·num_train_timesteps, the experts and guidance of `guided_velocity`
        (the negative: text only, may be a batch of one)."""
        if latents.ndim != 5:
            raise ValueError(f"Wan latents are (B, C, F, H, W), got {tuple(latents.shape)}")
        check_velocity_inputs(latents, sigmas, embeds)
        wanted = {"prompt_embeds", "condition", *(("image_embeds",) if self.image_branch else ())}
        if set(embeds) != wanted:
            raise ValueError(
                f"{self.name} conditioning holds {sorted(embeds)}, not {sorted(wanted)}: encode the prompts with their "
                "source images (encode_request)"
            )
        device = latents.device
        hidden = torch.cat([latents, embeds["condition"].to(device=device, dtype=latents.dtype)], dim=1)
        t = sigmas.to(device=device, dtype=torch.float32) * self.num_train_timesteps  # the Euler scheduler's timesteps
        return self.guided_velocity(
            transformer,
            hidden,
            t,
            embeds["prompt_embeds"].to(device),
            None if negative is None else negative["prompt_embeds"].to(device),
            guidance_scale=guidance_scale,
            image_embeds=embeds["image_embeds"].to(device) if self.image_branch else None,
        )
