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

Latents, σ grid (mu of the generated tokens only), true CFG with the norm rescale and the VAE scaling are Qwen-Image's
(`miles.models.qwen_image`'s public helpers). QwenImageEditPlusPipeline (2509, several references) is not this
family: its template, its 384² condition images and its batch of one differ (a folder of it is not recognised).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image
from torch import nn
from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

from miles.models.base import compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    check_velocity_inputs,
    dynamic_sampling_shift,
    dynamic_shift_sigmas,
    square_latent_side,
    training_shift,
)
from miles.models.media import Media
from miles.models.packing import pack_latents, unpack_latents
from miles.models.qwen_common import (
    check_no_guidance_embeds,
    decode_qwen_latents,
    encode_qwen_latents,
    qwen_mu,
    qwen_vae_scale_factor,
    trim_prompt_padding,
    true_cfg,
)

logger = logging.getLogger(__name__)

PIPELINE_REFERENCE_AREA = 1024 * 1024  # QwenImageEditPipeline.__call__'s calculate_dimensions target (pixels)
_QWEN_DEFAULT_SAMPLE_SIZE = 128  # QwenImageEditPipeline.default_sample_size: latents per side at the default size
TEXT_NAMES = ("prompt_embeds", "prompt_embeds_mask")  # the VL encoder's part of the conditioning (the negative's)


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
class QwenImageEditPipelineConfig(DiffusersFamily):
    """Qwen-Image-Edit pipeline folders (`QwenImageEditPipeline`): one source image per prompt.

    Guidance: `guidance_scale > 1` is the pipeline's true CFG (`true_cfg_scale` with a negative prompt, encoded
    with each prompt's image), rescaled to the conditional prediction's norm per packed token; 1 is the conditional
    branch alone.
    """

    name = "qwen-image-edit"
    pipeline_class_name = "QwenImageEditPipeline"
    transformer_class = QwenImageTransformer2DModel
    text_pipeline_class = "QwenImageEditPipeline"
    vae_class = "AutoencoderKLQwenImage"
    default_lora_targets = ("to_k", "to_q", "to_v", "to_out.0")  # Qwen-Image's (diffusers' LoRA training default)
    source_image_range = (1, 1)
    negative_per_prompt = True

    # networks
    def load_transformer(
        self, path: str | None = None, dtype: torch.dtype = torch.float32, *, empty: bool = False
    ) -> nn.Module:
        """The transformer (`DiffusersFamily`'s loader); a guidance-distilled one is refused."""
        model = super().load_transformer(path, dtype, empty=empty)
        check_no_guidance_embeds(model, path or self.path, self.pipeline_class_name)
        return model

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
        problem = self.source_image_problem([len(s) for s in images])
        if problem is not None or len(images) != count:
            raise ValueError(problem or f"{count} prompts but {len(images)} source image lists")
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
    def _encode_text(self, prompts: list[str], sources: list[Image.Image], device) -> Conditioning:
        pipe = self.text_pipeline()
        embeds, mask = pipe.encode_prompt(prompt=list(prompts), image=sources, device=pipe.text_encoder.device)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return Conditioning({"prompt_embeds": embeds, "prompt_embeds_mask": mask}).to(device=device)

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
        text = self._encode_text(prompts, sources, device)
        pixels = self.image_processor().preprocess(sources, height, width)
        vae = self.cached_vae()
        # one image per VAE call, as the pipeline encodes them with a generator per prompt
        latents = torch.cat([encode_qwen_latents(vae, pixels[i : i + 1]) for i in range(len(sources))])
        return Conditioning({**text, "image_latents": latents.to(device=device)})

    def encode_negative_of_images(
        self, negative_prompt: str, source_images: list[list[np.ndarray]], device: torch.device | str | None = None
    ) -> Conditioning:
        """The negative prompt read with each prompt's source image: one text row (`TEXT_NAMES`) per prompt
        (`predict_velocity` takes the reference latents from the prompt's conditioning)."""
        with torch.no_grad():
            sources, _, _ = self._resized_sources(source_images, len(source_images))
            return self._encode_text([negative_prompt] * len(sources), sources, device)

    # media
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """`encode_qwen_latents` with the folder's VAE."""
        return encode_qwen_latents(self.cached_vae(), images, generator)

    def decode_latents(self, x0: torch.Tensor) -> Media:
        """`decode_qwen_latents` with the folder's VAE."""
        return decode_qwen_latents(self.cached_vae(), x0)

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
        `img_shapes` of both, timestep σ, the prompt mask (none when no token is padding), the output's noise tokens.
        With `guidance_scale` w > 1, true CFG against `negative` (one row, or one per prompt), both branches in one
        batched forward (the pipeline runs two)."""
        check_velocity_inputs(latents, sigmas, embeds)
        batch, _, height, width = latents.shape
        reference = embeds["image_latents"]
        ref_height, ref_width = reference.shape[-2:]
        if height % 2 or width % 2 or ref_height % 2 or ref_width % 2:
            raise ValueError(
                f"Qwen-Image latents pack 2x2 patches: sides must be even, got {height}x{width} and reference "
                f"{ref_height}x{ref_width}"
            )
        dtype, device = compute_dtype(transformer), latents.device
        timestep = (sigmas.to(device=device, dtype=torch.float32) * 1000.0).to(dtype) / 1000
        noise_tokens = pack_latents(latents.to(dtype))
        hidden = torch.cat([noise_tokens, pack_latents(reference.to(device=device, dtype=dtype))], dim=1)
        text = Conditioning({name: embeds[name] for name in TEXT_NAMES})
        cfg = guidance_scale > 1.0
        if cfg:
            if negative is None:
                raise ValueError("guidance_scale > 1 (true CFG) needs negative embeddings (encode_negative_of_images)")
            text = Conditioning.cat([negative.expand(batch), text])  # padded to one length
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        prompt_embeds, mask = trim_prompt_padding(text)
        pred = transformer(
            hidden_states=hidden,
            timestep=timestep,
            guidance=None,
            encoder_hidden_states_mask=None if mask is None else mask.to(device),
            encoder_hidden_states=prompt_embeds.to(device=device, dtype=dtype),
            img_shapes=[[(1, height // 2, width // 2), (1, ref_height // 2, ref_width // 2)]] * hidden.shape[0],
            return_dict=False,
        )[0][:, : noise_tokens.shape[1]].float()
        if cfg:
            pred = true_cfg(*pred.chunk(2), guidance_scale)
        return unpack_latents(pred, height, width)

    def mu(self, resolution: int | None = None) -> float:
        """The pipeline's resolution-dependent shift of the generated tokens (`qwen_mu`)."""
        _, h, w = self.latent_shape(resolution)
        return qwen_mu(self.scheduler_config(), h, w)

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """The pipeline's grid: σ = linspace(1, 1/N, N) through the folder's scheduler with `mu(resolution)`, then 0."""
        return dynamic_shift_sigmas(self.scheduler_config(), num_steps, self.mu(resolution))

    def sampling_shift(self, resolution: int | None = None) -> float:
        """The pipeline's time shift at `resolution` as a static shift (e^mu)."""
        return dynamic_sampling_shift(self.scheduler_config(), self.mu(resolution))

    # geometry
    @property
    def scheduler_shift(self) -> float:
        """The training table's shift: 1 under dynamic shifting, the config's `shift` otherwise."""
        return training_shift(self.scheduler_config())

    @property
    def vae_scale_factor(self) -> int:
        return qwen_vae_scale_factor(self.cached_json("vae", "config.json"))

    @property
    def patch_size(self) -> int:
        return 2  # the pipeline's 2x2 packing

    @property
    def default_resolution(self) -> int:
        """The folder's suggested resolution, else the pipeline's default (default_sample_size x vae_scale_factor,
        1024 for Qwen-Image-Edit)."""
        return int(self.folder_default("resolution") or _QWEN_DEFAULT_SAMPLE_SIZE * self.vae_scale_factor)

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int]:
        """(z_dim, h, w) of the generated image's latents (square), without the VAE's frame axis."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * self.patch_size
        side = square_latent_side(resolution, self.vae_scale_factor, multiple, "VAE factor x 2x2 packing")
        return int(self.cached_json("vae", "config.json")["z_dim"]), side, side
