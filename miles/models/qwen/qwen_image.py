"""The Qwen-Image family: QwenImageTransformer2DModel, a Qwen2.5-VL text encoder, AutoencoderKLQwenImage, flow matching
with a resolution-dependent shift. Computed exactly as `diffusers.QwenImagePipeline` does, from a local pipeline folder; what every Qwen-Image folder
shares (VAE, true CFG, σ grid, geometry) is `miles.models.qwen.folder`'s.

Latent layout: miles holds Qwen-Image latents unpacked and without the VAE's frame axis, (C, H, W) like SD3's and
FLUX's. The pipeline draws its noise as (1, C, H, W) per sample and packs 2x2 patches into a (H/2 * W/2, 4C)
sequence; its VAE is a video VAE that sees images as one frame. `predict_velocity` packs (and unpacks the velocity),
`encode_images` / `decode_latents` add and drop the frame axis. Packing is a permutation and the frame axis has size
1, so a seed gives the pipeline's noise, and Euler steps, SDE log-probs (means over dims), rewards and the trainer need
nothing Qwen-specific; only true CFG's norm rescale reads the packed layout (the norm over each patch's 4C values),
and it is computed there.

Prompts: the pipeline wraps each prompt in its chat template, runs the text encoder, keeps the last hidden state
of the valid tokens, drops the template's first 34 tokens (its system part) and pads the batch to its longest prompt
with a 0/1 mask. Lengths vary between batches, so the conditioning holds that mask (`prompt_embeds_mask`) next to
the embeddings; `Conditioning.cat` zero-pads sequences to one length (padding the mask with 0), and
`predict_velocity` trims the columns that are padding in every row and passes no mask when none is left, as the
pipeline does for a batch without padding.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from miles.models.base import compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import check_velocity_inputs
from miles.models.options import options_of
from miles.models.packing import pack_latents, unpack_latents
from miles.models.qwen.folder import QwenFolderFamily

logger = logging.getLogger(__name__)

_QWEN_MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default max_sequence_length


@register_train_pipeline_config
class QwenImagePipelineConfig(QwenFolderFamily):
    """Qwen-Image pipeline folders (`QwenImagePipeline`).

    Guidance: `guidance_scale > 1` is the pipeline's true CFG (`true_cfg_scale` with a negative prompt), the
    combined prediction rescaled to the conditional one's norm per packed token; 1 is the conditional branch alone.
    The VAE is Qwen's video VAE on one frame, normalized per channel.
    """

    name = "qwen-image"
    options = options_of("qwen-image")
    pipeline_class_name = "QwenImagePipeline"
    text_pipeline_class = "QwenImagePipeline"

    # text
    @property
    def max_sequence_length(self) -> int:
        """Text tokens kept per prompt (after the template's): QwenImagePipeline's default, 512."""
        return _QWEN_MAX_SEQUENCE_LENGTH

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """`QwenImagePipeline.encode_prompt(max_sequence_length=512)` (`encode_text`): `prompt_embeds` (B, L, D) and
        `prompt_embeds_mask` (B, L)."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        return self.encode_text(prompts, device, num_images_per_prompt=1, max_sequence_length=self.max_sequence_length)

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
        """The velocity (float32, latents' shape (B, C, H, W)) at noise levels `sigmas` (B,), as QwenImagePipeline's
        denoising loop computes it: the packed latents, `img_shapes` of one frame of (H/2, W/2) patches, through
        `guided_velocity` (true CFG with the norm rescale when w > 1). `negative` may be a batch of one (broadcast).
        """
        check_velocity_inputs(latents, sigmas, embeds)
        _, _, height, width = latents.shape
        if height % 2 or width % 2:
            raise ValueError(
                f"Qwen-Image latents pack 2x2 patches: height and width must be even, got {height}x{width}"
            )
        hidden = pack_latents(latents.to(compute_dtype(transformer)))
        shapes = [(1, height // 2, width // 2)]
        pred = self.guided_velocity(
            transformer, hidden, shapes, sigmas, embeds, guidance_scale=guidance_scale, negative=negative
        )
        return unpack_latents(pred, height, width)
