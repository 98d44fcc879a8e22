"""Tiny Qwen-Image-Edit and Qwen-Image-Edit-Plus pipelines built offline: tiny Qwen-Image's networks
(`miles.models.qwen.tiny`) with a Qwen2.5-VL vision tower that now runs, and a Qwen2VLProcessor built in code
around the same byte-level tokenizer (`Qwen2VLImageTextProcessor`: the same code without the video processor, which
would need torchvision).

The tokenizer knows the words and punctuation of the editing pipelines' prompt template (the same system part in
both) as whole tokens, so its system part is the 64 tokens the pipelines drop (`prompt_template_encode_start_idx`),
as with the real tokenizer; the Plus folder's also knows "Picture" (its "Picture k:" image labels). The folders
record a small `reference_area` (`miles.models.qwen.qwen_image_edit`): the pipelines' one megapixel would make every VAE
encode of a source image cost seconds on a CPU; the Plus folder also records a small `condition_area` for the VL
encoder's copies of the images (the pipeline's 384² would be ~200 vision tokens per image), larger than the
reference area and the output size, so that the three sizes stay apart as in the real pipeline.
"""

from __future__ import annotations

import logging

from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from miles.models.qwen.qwen_image_edit import Qwen2VLImageTextProcessor
from miles.models.qwen.tiny import TEMPLATE_WORDS, tiny_qwen_image_components
from miles.models.tiny import SHAPES_WORDS, build_qwen2_tokenizer, eval_mode, save_tiny_folder

logger = logging.getLogger(__name__)

# the words and punctuation runs of QwenImageEditPipeline.prompt_template_encode's system part, each one token of
# the real Qwen2 tokenizer (" (", "'s", "),": Qwen2's pre-tokenizer keeps them whole)
EDIT_TEMPLATE_WORDS: tuple[str, ...] = (
    *(
        "Describe key features of input color size texture objects then explain how user text instruction should "
        "alter or modify Generate a new that meets requirements while maintaining consistency with original where "
        "appropriate"
    ).split(),
    "(",
    "'s",
    "),",
)
PLUS_IMAGE_WORDS: tuple[str, ...] = ("Picture",)  # QwenImageEditPlusPipeline's "Picture {k}: " image labels
REFERENCE_AREA = 64 * 64  # the tiny folders' reference area (pixels): 16 x 16 latents, 64 packed tokens
CONDITION_AREA = 96 * 96  # the tiny Plus folder's VL condition area (pixels): 84 x 84 after the VL processor, 9 tokens
# Qwen2.5-VL's image processor: 14-pixel patches merged 2 x 2 (the tiny vision tower's), at least 56 x 56 pixels
VISION_PATCH, VISION_MERGE, VISION_TEMPORAL_PATCH = 14, 2, 2


def build_tiny_qwen_image_edit_pipeline(
    seed: int = 0, resolution: int = 32, *, plus: bool = False
) -> QwenImageEditPipeline | QwenImageEditPlusPipeline:
    """The tiny Qwen-Image-Edit pipeline (`plus`: Qwen-Image-Edit-Plus, several source images) in float32, eval
    mode, seeded random weights, Qwen-Image's scheduler."""
    tokenizer = build_qwen2_tokenizer(
        TEMPLATE_WORDS + EDIT_TEMPLATE_WORDS + SHAPES_WORDS + (PLUS_IMAGE_WORDS if plus else ())
    )
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=VISION_PATCH, merge_size=VISION_MERGE, temporal_patch_size=VISION_TEMPORAL_PATCH
    )
    processor = Qwen2VLImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer)
    components = tiny_qwen_image_components(tokenizer, seed, resolution)
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return eval_mode(pipeline_class(**components, processor=processor))


def save_tiny_qwen_image_edit_pipeline(path: str, seed: int = 0, resolution: int = 32, *, plus: bool = False) -> str:
    """Build the tiny Qwen-Image-Edit pipeline (`plus`: -Plus) and write it as a diffusers folder (safetensors);
    returns `path`."""
    pipe = build_tiny_qwen_image_edit_pipeline(seed=seed, resolution=resolution, plus=plus)
    areas = {"reference_area": REFERENCE_AREA, **({"condition_area": CONDITION_AREA} if plus else {})}
    save_tiny_folder(pipe, path, resolution=resolution, **areas)
    name = "Qwen-Image-Edit-Plus" if plus else "Qwen-Image-Edit"
    logger.info("wrote tiny %s pipeline (seed %d, %dx%d) to %s", name, seed, resolution, resolution, path)
    return path
