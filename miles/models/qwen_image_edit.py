"""The Qwen-Image-Edit family: Qwen-Image's networks (QwenImageTransformer2DModel, AutoencoderKLQwenImage) guided by
one source image per prompt, computed exactly as `diffusers.QwenImageEditPipeline` does, from a local pipeline folder.

What the pipeline does with the source image, and where it lives here (`encode_prompts`, all of it conditioning):
- it resizes the image (Lanczos) to about `reference_area` pixels at the image's aspect ratio, sides multiples of 32
  (`calculate_dimensions`; one megapixel, whatever the output size; a tiny folder records a smaller area);
- the Qwen2.5-VL encoder reads the prompt WITH that image (its vision tokens inside the chat template): the last
  hidden state after the template's 64-token system part is `prompt_embeds`, zero-padded with `prompt_embeds_mask`
  as in Qwen-Image; the negative prompt is encoded with the same image, so the negative differs per prompt
  (`negative_per_prompt`: `encode_negative_of_images` returns one row per prompt, text only);
- the VAE encodes it (posterior mode) into normalized `image_latents` (B, C, h, w), kept unpacked: its shape is
  the reference's `img_shapes` entry. `predict_velocity` packs them after the noise tokens along the sequence and
  keeps the transformer's output on the noise tokens only.

Latents, σ grid (mu of the generated tokens only), true CFG with the norm rescale and the VAE scaling are every
Qwen-Image folder's (`miles.models.qwen_folder`). QwenImageEditPlusPipeline (2509, several references) is not this
family: its template, its 384² condition images and its batch of one differ (a folder of it is not recognised).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image
from torch import nn
from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

from miles.models.base import compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import check_velocity_inputs
from miles.models.packing import pack_latents, unpack_latents
from miles.models.qwen_folder import QwenFolderFamily, encode_qwen_latents

logger = logging.getLogger(__name__)

PIPELINE_REFERENCE_AREA = 1024 * 1024  # QwenImageEditPipeline.__call__'s calculate_dimensions target (pixels)


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor, which transformers builds on torchvision only: text and
    images (all QwenImageEditPipeline passes) are processed by the same code. The tiny folder names this class (a
    real folder names Qwen2VLProcessor, and loading it needs torchvision); diffusers loads it from this module."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


@register_train_pipeline_config
class QwenImageEditPipelineConfig(QwenFolderFamily):
    """Qwen-Image-Edit pipeline folders (`QwenImageEditPipeline`): one source image per prompt.

    Guidance: `guidance_scale > 1` is the pipeline's true CFG (`true_cfg_scale` with a negative prompt, encoded
    with each prompt's image), rescaled to the conditional prediction's norm per packed token; 1 is the conditional
    branch alone.
    """

    name = "qwen-image-edit"
    pipeline_class_name = "QwenImageEditPipeline"
    text_pipeline_class = "QwenImageEditPipeline"
    source_image_range = (1, 1)
    negative_per_prompt = True

    # the source image
    @property
    def reference_area(self) -> int:
        """Pixels the source image is resized to: the pipeline's one megapixel, or the area a tiny folder records
        (`folder_default`; its VAE would take seconds per image on a CPU otherwise)."""
        return int(self.folder_default("reference_area") or PIPELINE_REFERENCE_AREA)

    def reference_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the resized source image: `calculate_dimensions` of `reference_area` at its ratio."""
        ref_width, ref_height, _ = calculate_dimensions(self.reference_area, width / height)
        return int(ref_width), int(ref_height)

    def _resized_sources(self, images: list[list[np.ndarray]], count: int) -> tuple[list[Image.Image], int, int]:
        """Each prompt's source image resized as the pipeline resizes it, and (width, height)."""
        self.check_source_images(count, images)
        pil = [Image.fromarray(np.asarray(s[0], dtype=np.uint8)) for s in images]
        if len({p.size for p in pil}) != 1:
            raise ValueError(
                f"the {self.name} family resizes a batch's source images to the first one's shape, as "
                f"QwenImageEditPipeline does; got sizes {sorted({p.size for p in pil})}: resize them to one size"
            )
        width, height = self.reference_size(*pil[0].size)
        return self.image_processor().resize(pil, height, width), width, height

    def image_processor(self) -> VaeImageProcessor:
        """The pipeline's VaeImageProcessor (Lanczos resizes, [-1, 1] pixels)."""
        return VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    # text
    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        device: torch.device | str | None = None,
        *,
        images: list[list[np.ndarray]] | None = None,
    ) -> Conditioning:
        """`prompt_embeds` (B, L, D) and `prompt_embeds_mask` (B, L) of each prompt read with its source image
        (`QwenImageEditPipeline.encode_prompt`), and `image_latents` (B, C, h, w) float32, the normalized VAE
        posterior mode of the resized source image. `images`: one list of one (H, W, 3) uint8 image per prompt."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        if images is None:
            raise ValueError(f"the {self.name} family edits a source image: encode_prompts needs images=")
        sources, width, height = self._resized_sources(images, len(prompts))
        text = self.encode_text(prompts, device, image=sources)
        pixels = self.image_processor().preprocess(sources, height, width)
        vae = self.cached_vae()
        # one image per VAE call, as the pipeline encodes them with a generator per prompt
        latents = torch.cat([encode_qwen_latents(vae, pixels[i : i + 1]) for i in range(len(sources))])
        return Conditioning({**text, "image_latents": latents.to(device=device)})

    def encode_negative_of_images(
        self, negative_prompt: str, source_images: list[list[np.ndarray]], device: torch.device | str | None = None
    ) -> Conditioning:
        """The negative prompt read with each prompt's source image: one text row (`QWEN_TEXT`) per prompt
        (`predict_velocity` takes the reference latents from the prompt's conditioning)."""
        with torch.no_grad():
            sources, _, _ = self._resized_sources(source_images, len(source_images))
            return self.encode_text([negative_prompt] * len(sources), device, image=sources)

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
        """The velocity (float32, latents' shape (B, C, H, W)) at noise levels `sigmas` (B,), as
        QwenImageEditPipeline's loop computes it: the packed latents followed by the packed `image_latents`,
        `img_shapes` of both, through `guided_velocity` (with w > 1 true CFG against `negative`, one row or one per
        prompt); the output's noise tokens."""
        check_velocity_inputs(latents, sigmas, embeds)
        _, _, height, width = latents.shape
        reference = embeds["image_latents"]
        ref_height, ref_width = reference.shape[-2:]
        if height % 2 or width % 2 or ref_height % 2 or ref_width % 2:
            raise ValueError(
                f"Qwen-Image latents pack 2x2 patches: sides must be even, got {height}x{width} and reference "
                f"{ref_height}x{ref_width}"
            )
        dtype, device = compute_dtype(transformer), latents.device
        noise_tokens = pack_latents(latents.to(dtype))
        hidden = torch.cat([noise_tokens, pack_latents(reference.to(device=device, dtype=dtype))], dim=1)
        pred = self.guided_velocity(
            transformer,
            hidden,
            [(1, height // 2, width // 2), (1, ref_height // 2, ref_width // 2)],
            sigmas,
            embeds,
            guidance_scale=guidance_scale,
            negative=negative,
            noise_tokens=noise_tokens.shape[1],
        )
        return unpack_latents(pred, height, width)
