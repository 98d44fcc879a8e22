"""The Qwen-Image editing families: Qwen-Image's networks (QwenImageTransformer2DModel, AutoencoderKLQwenImage) guided
by source images, computed exactly as their diffusers pipelines do, from a local pipeline folder.

- `qwen-image-edit` (`QwenImageEditPipeline`): one source image per prompt;
- `qwen-image-edit-plus` (`QwenImageEditPlusPipeline`, Qwen-Image-Edit-2509): one to three source images per
  prompt ("Picture 1: ... Picture 2: ..." in its prompt template).

What the pipelines do with the source images, and where it lives here (`encode_prompts`, all of it conditioning):
- the Qwen2.5-VL encoder reads the prompt WITH the images (their vision tokens inside the chat template): the last
  hidden state after the template's 64-token system part is `prompt_embeds`, zero-padded with `prompt_embeds_mask`
  as in Qwen-Image. Edit reads the reference image itself; Plus reads each image resized to its own condition
  size, about 384² pixels (`CONDITION_IMAGE_SIZE`; a tiny folder records a smaller `condition_area`), at the
  image's aspect ratio. The negative prompt is encoded with
  the same images, so the negative differs per prompt (`negative_per_prompt`: `encode_negative_of_images` returns
  one row per prompt, text only);
- each image is resized (Lanczos) to about `reference_area` pixels at its aspect ratio, sides multiples of 32
  (`calculate_dimensions`; one megapixel, whatever the output size; a tiny folder records a smaller area), and the
  VAE encodes it (posterior mode) into normalized reference latents. Edit resizes a batch to its first image's
  size and keeps them unpacked, `image_latents` (B, C, h, w); Plus sizes each image by its own ratio and keeps one
  prompt's references packed one after the other, `image_latents` (B, N, 4C), with their patch grids
  `image_shapes` (B, K, 2) (rows, columns; rows of zeros pad a prompt with fewer images).
- `predict_velocity` (one copy for both): the packed noise tokens followed by the reference tokens along the
  sequence, `img_shapes` of the output and of each reference, the transformer's output on the noise tokens only.
  The transformer takes one `img_shapes` for a whole batch (its RoPE reads the first row's), so rows whose
  references differ in number or size run in separate forwards: each row then sees exactly what the pipeline
  gives it alone (QwenImageEditPlusPipeline takes one prompt per call).

Latents, σ grid (mu of the generated tokens only), true CFG with the norm rescale and the VAE scaling are every
Qwen-Image folder's (`miles.models.qwen.folder`).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE
from PIL import Image
from torch import nn
from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

from miles.models.base import compute_dtype, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import check_velocity_inputs
from miles.models.options import options_of
from miles.models.packing import pack_latents, unpack_latents
from miles.models.qwen.folder import QwenFolderFamily, encode_qwen_latents
from miles.utils.simulation import real_tensors, simulating

logger = logging.getLogger(__name__)

# the reference (VAE) images' area in pixels: QwenImageEditPipeline.__call__'s calculate_dimensions target (1024²),
# QwenImageEditPlusPipeline's VAE_IMAGE_SIZE (the same)
PIPELINE_REFERENCE_AREA = VAE_IMAGE_SIZE
PLUS_MAX_SOURCE_IMAGES = 3  # Qwen-Image-Edit-2509's model card: one to three input images


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor, which transformers builds on torchvision only: text and
    images (all the editing pipelines pass) are processed by the same code. The tiny folders name this class (a
    real folder names Qwen2VLProcessor, and loading it needs torchvision); diffusers loads it from this module."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class RealTensorsProcessor:
    """The processor, its outputs real under the planner's fake tensors: its token ids are checked by value (the
    image placeholders counted against the images), which a fake tensor does not hold."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with real_tensors():
            return self.processor(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.processor, name)


class ShapeOnlyTextEncoder:
    """Stands in for the Qwen2.5-VL text encoder under the planner's fake tensors: its last hidden state, of the shape
    the real forward returns for the processor's ids, holding nothing. Its vision tower sizes its tokens from the
    values of each image's patch grid, which fake tensors do not hold, so the forward's transient memory is not
    simulated; the encoder's weights are counted where the engine loads them."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        embedding = self.encoder.get_input_embeddings().weight
        hidden = torch.empty(*input_ids.shape, embedding.shape[1], dtype=embedding.dtype, device=embedding.device)
        return SimpleNamespace(hidden_states=(hidden,))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.encoder, name)


def as_pil(image: np.ndarray) -> Image.Image:
    """An (H, W, 3) uint8 source image as the PIL image the pipelines take."""
    return Image.fromarray(np.asarray(image, dtype=np.uint8))


class QwenEditFamily(QwenFolderFamily):
    """What the Qwen-Image editing pipelines share: reference images at `reference_area`, VAE-encoded one by one,
    their tokens after the noise tokens (`predict_velocity`), negatives read with each prompt's images. A subclass
    encodes its prompts and says where its conditioning keeps the references (`reference_tokens`).

    Guidance: `guidance_scale > 1` is the pipelines' true CFG (`true_cfg_scale` with a negative prompt, encoded
    with each prompt's images), rescaled to the conditional prediction's norm per packed token; 1 is the
    conditional branch alone.
    """

    negative_per_prompt = True

    def encode_text(
        self, prompts: list[str], device: torch.device | str | None = None, **encode_kwargs: Any
    ) -> Conditioning:
        """`QwenFolderFamily.encode_text`; under the planner's fake tensors one prompt at a time (no padding to
        split), its ids and image grids made for real and the encoder standing in by shape (`ShapeOnlyTextEncoder`)."""
        if not simulating():
            return super().encode_text(prompts, device, **encode_kwargs)
        images = encode_kwargs.pop("image")
        per_prompt = [images] if len(prompts) == 1 else [[image] for image in images]  # edit: one image a prompt
        pipe, encode = self.text_pipeline(), super().encode_text
        encoder, processor = pipe.text_encoder, pipe.processor
        pipe.text_encoder, pipe.processor = ShapeOnlyTextEncoder(encoder), RealTensorsProcessor(processor)
        try:
            rows = [encode([p], device, image=i, **encode_kwargs) for p, i in zip(prompts, per_prompt)]
        finally:
            pipe.text_encoder, pipe.processor = encoder, processor
        return Conditioning.cat(rows)

    # the source images
    @property
    def reference_area(self) -> int:
        """Pixels a reference image is resized to: the pipelines' one megapixel, or the area a tiny folder records
        (`folder_default`; its VAE would take seconds per image on a CPU otherwise)."""
        return int(self.folder_default("reference_area") or PIPELINE_REFERENCE_AREA)

    def reference_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of a resized reference image: `calculate_dimensions` of `reference_area` at its ratio."""
        return area_size(self.reference_area, width, height)

    def image_processor(self) -> VaeImageProcessor:
        """The pipelines' VaeImageProcessor (Lanczos resizes, [-1, 1] pixels)."""
        return VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    def encode_reference(self, image: Image.Image, width: int, height: int) -> torch.Tensor:
        """Normalized VAE latents (1, C, height / f, width / f), float32, of `image` resized to width x height
        (posterior mode; the pipelines encode each image in its own VAE call)."""
        pixels = self.image_processor().preprocess(image, height, width)
        return encode_qwen_latents(self.cached_vae(), pixels)

    @abstractmethod
    def reference_tokens(self, embeds: Conditioning) -> tuple[torch.Tensor, list[tuple[tuple[int, int], ...]]]:
        """The packed reference tokens of each row (B, N, 4C) (a row may end in padding) and each row's references'
        patch grids ((rows, columns) per image, in sequence order; their products sum to the row's tokens)."""

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
        """The velocity (float32, latents' shape (B, C, H, W)) at noise levels `sigmas` (B,), as the editing
        pipelines' loops compute it: the packed latents followed by the row's reference tokens, `img_shapes` of
        both, through `guided_velocity` (with w > 1 true CFG against `negative`, one row or one per prompt); the
        output's noise tokens. Rows whose references differ in grids run in separate forwards (one `img_shapes`
        per forward), their velocities put back in row order."""
        check_velocity_inputs(latents, sigmas, embeds)
        _, _, height, width = latents.shape
        if height % 2 or width % 2:
            raise ValueError(
                f"Qwen-Image latents pack 2x2 patches: height and width must be even, got {height}x{width}"
            )
        tokens, grids = self.reference_tokens(embeds)
        dtype, device = compute_dtype(transformer), latents.device
        noise_tokens = pack_latents(latents.to(dtype))
        groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for row, grid in enumerate(grids):
            groups.setdefault(grid, []).append(row)
        preds, order = [], []
        for grid, rows in groups.items():
            whole = len(rows) == len(grids)  # one group: the batch as it is, without copies
            index = torch.tensor(rows, device=device)
            reference = tokens if whole else tokens[rows]
            reference = reference[:, : sum(h * w for h, w in grid)].to(device=device, dtype=dtype)
            noise = noise_tokens if whole else noise_tokens[index]
            negative_rows = negative
            if negative is not None and negative.batch_size > 1 and not whole:
                negative_rows = negative.rows(rows)
            preds.append(
                self.guided_velocity(
                    transformer,
                    torch.cat([noise, reference], dim=1),
                    [(1, height // 2, width // 2), *((1, h, w) for h, w in grid)],
                    sigmas if whole else sigmas[index.to(sigmas.device)],
                    embeds if whole else embeds.rows(rows),
                    guidance_scale=guidance_scale,
                    negative=negative_rows,
                    noise_tokens=noise_tokens.shape[1],
                )
            )
            order.extend(rows)
        pred = preds[0] if len(preds) == 1 else torch.cat(preds)[torch.argsort(torch.tensor(order, device=device))]
        return unpack_latents(pred, height, width)


def area_size(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of about `area` pixels at width / height's ratio, sides multiples of 32: the pipelines'
    `calculate_dimensions`."""
    new_width, new_height = calculate_dimensions(area, width / height)[:2]
    return int(new_width), int(new_height)


@register_train_pipeline_config
class QwenImageEditPipelineConfig(QwenEditFamily):
    """Qwen-Image-Edit pipeline folders (`QwenImageEditPipeline`): one source image per prompt, read by the VL
    encoder and the VAE at one size (`reference_area`), a batch resized to its first image's shape."""

    name = "qwen-image-edit"
    options = options_of("qwen-image-edit")
    pipeline_class_name = "QwenImageEditPipeline"
    text_pipeline_class = "QwenImageEditPipeline"
    source_image_range = (1, 1)

    def _resized_sources(self, images: list[list[np.ndarray]], count: int) -> tuple[list[Image.Image], int, int]:
        """Each prompt's source image resized as the pipeline resizes it, and (width, height)."""
        self.check_source_images(count, images)
        pil = [as_pil(s[0]) for s in images]
        if len({p.size for p in pil}) != 1:
            raise ValueError(
                f"the {self.name} family resizes a batch's source images to the first one's shape, as "
                f"QwenImageEditPipeline does; got sizes {sorted({p.size for p in pil})}: resize them to one size"
            )
        width, height = self.reference_size(*pil[0].size)
        # as the pipeline calls it: diffusers' resize returns a list as given (its annotation takes one image), and
        # the pipeline's preprocess resizes each image to (height, width)
        processor = self.image_processor()
        resized: list[Image.Image] = processor.resize(pil, height, width)  # type: ignore[arg-type,assignment]
        return resized, width, height

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
        latents = torch.cat([self.encode_reference(source, width, height) for source in sources])
        return Conditioning({**text, "image_latents": latents.to(device=device)})

    def encode_negative_of_images(
        self, negative_prompt: str, source_images: list[list[np.ndarray]], device: torch.device | str | None = None
    ) -> Conditioning:
        """The negative prompt read with each prompt's source image: one text row (`QWEN_TEXT`) per prompt
        (`predict_velocity` takes the reference latents from the prompt's conditioning)."""
        with torch.no_grad():
            sources, _, _ = self._resized_sources(source_images, len(source_images))
            return self.encode_text([negative_prompt] * len(sources), device, image=sources)

    def reference_tokens(self, embeds: Conditioning) -> tuple[torch.Tensor, list[tuple[tuple[int, int], ...]]]:
        """`image_latents` packed; one reference of the same grid in every row."""
        reference = embeds["image_latents"]
        ref_height, ref_width = reference.shape[-2:]
        if ref_height % 2 or ref_width % 2:
            raise ValueError(f"Qwen-Image latents pack 2x2 patches: reference is {ref_height}x{ref_width}")
        grid = ((ref_height // 2, ref_width // 2),)
        return pack_latents(reference), [grid] * reference.shape[0]


@register_train_pipeline_config
class QwenImageEditPlusPipelineConfig(QwenEditFamily):
    """Qwen-Image-Edit-Plus pipeline folders (`QwenImageEditPlusPipeline`, Qwen-Image-Edit-2509): one to three
    source images per prompt, each read by the VL encoder at its condition size (about 384² pixels) and by the VAE
    at `reference_area`, each at its own aspect ratio. The pipeline takes one prompt per call; the family encodes a
    batch prompt by prompt, and `predict_velocity` batches the rows whose references share their grids."""

    name = "qwen-image-edit-plus"
    options = options_of("qwen-image-edit-plus")
    pipeline_class_name = "QwenImageEditPlusPipeline"
    text_pipeline_class = "QwenImageEditPlusPipeline"
    source_image_range = (1, PLUS_MAX_SOURCE_IMAGES)

    @property
    def condition_area(self) -> int:
        """Pixels the VL encoder's copy of a source image is resized to: the pipeline's 384² (CONDITION_IMAGE_SIZE),
        or the area a tiny folder records (`folder_default`: fewer vision tokens on a CPU)."""
        return int(self.folder_default("condition_area") or CONDITION_IMAGE_SIZE)

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the image the VL encoder reads: `calculate_dimensions` of `condition_area` at its
        ratio."""
        return area_size(self.condition_area, width, height)

    def _condition_images(self, sources: list[Image.Image]) -> list[Image.Image]:
        """One prompt's source images resized for the VL encoder, as the pipeline resizes them."""
        processor = self.image_processor()
        return [resized_pil(processor, image, *self.condition_size(*image.size)[::-1]) for image in sources]

    def _sources(self, images: list[list[np.ndarray]] | None, count: int) -> list[list[Image.Image]]:
        if images is None:
            raise ValueError(f"the {self.name} family edits source images: encode_prompts needs images=")
        self.check_source_images(count, images)
        return [[as_pil(image) for image in prompt_images] for prompt_images in images]

    # text
    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        device: torch.device | str | None = None,
        *,
        images: list[list[np.ndarray]] | None = None,
    ) -> Conditioning:
        """Per prompt, as QwenImageEditPlusPipeline encodes its one prompt: `prompt_embeds` (1, L, D) and
        `prompt_embeds_mask` of the prompt read with its condition images ("Picture k: ..." each), `image_latents`
        (1, N, 4C) float32, each resized image's normalized VAE posterior mode packed, in the images' order, and
        `image_shapes` (1, K, 2) int64, their patch grids; rows joined by `Conditioning.cat` (zero-padded: masks
        and grids of zeros mark the padding). `images`: one list of (H, W, 3) uint8 images per prompt."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        rows = []
        for prompt, sources in zip(prompts, self._sources(images, len(prompts)), strict=True):
            text = self.encode_text([prompt], device, image=self._condition_images(sources))
            references = [self.encode_reference(image, *self.reference_size(*image.size)) for image in sources]
            grids = [(r.shape[-2] // 2, r.shape[-1] // 2) for r in references]
            rows.append(
                Conditioning(
                    {
                        **text,
                        "image_latents": torch.cat([pack_latents(r) for r in references], dim=1).to(device=device),
                        "image_shapes": torch.tensor([grids], dtype=torch.long, device=device),
                    }
                )
            )
        return Conditioning.cat(rows)

    def encode_negative_of_images(
        self, negative_prompt: str, source_images: list[list[np.ndarray]], device: torch.device | str | None = None
    ) -> Conditioning:
        """The negative prompt read with each prompt's condition images: one text row (`QWEN_TEXT`) per prompt,
        encoded prompt by prompt as the pipeline does."""
        with torch.no_grad():
            sources = self._sources(source_images, len(source_images))
            rows = [self.encode_text([negative_prompt], device, image=self._condition_images(s)) for s in sources]
            return Conditioning.cat(rows)

    def reference_tokens(self, embeds: Conditioning) -> tuple[torch.Tensor, list[tuple[tuple[int, int], ...]]]:
        """`image_latents` as they are; each row's grids from `image_shapes` without its padding (zero rows)."""
        shapes = embeds["image_shapes"].tolist()
        return embeds["image_latents"], [tuple((h, w) for h, w in row if h * w) for row in shapes]


def resized_pil(processor: VaeImageProcessor, image: Image.Image, height: int, width: int) -> Image.Image:
    """`processor.resize` of a PIL image, which is a PIL image (diffusers types it with the tensor and array cases)."""
    resized = processor.resize(image, height, width)
    if not isinstance(resized, Image.Image):
        raise TypeError(f"VaeImageProcessor.resize turned a PIL image into a {type(resized).__name__}")
    return resized
