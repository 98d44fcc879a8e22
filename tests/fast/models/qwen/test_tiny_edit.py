"""The tiny Qwen-Image-Edit builders (miles/models/qwen/tiny_edit.py): Edit and Edit-Plus folders on Qwen-Image's
networks, with the reference area (and Plus's condition area) the family reads in place of the pipeline's hard-coded
megapixel as run defaults."""

from __future__ import annotations

import pytest

from miles.models.qwen.tiny import TEXT_WIDTH
from miles.models.qwen.tiny_edit import CONDITION_AREA, REFERENCE_AREA, VISION_MERGE, VISION_PATCH
from tests.fast.models.tiny_checks import check_tiny_folder


@pytest.mark.parametrize(
    ("fixture", "pipeline_class", "family", "areas"),
    [
        ("tiny_qwen_image_edit_dir", "QwenImageEditPipeline", "qwen-image-edit", {"reference_area": REFERENCE_AREA}),
        (
            "tiny_qwen_image_edit_plus_dir",
            "QwenImageEditPlusPipeline",
            "qwen-image-edit-plus",
            {"reference_area": REFERENCE_AREA, "condition_area": CONDITION_AREA},
        ),
    ],
)
def test_each_variant_records_the_areas_it_was_built_for(request, fixture, pipeline_class, family, areas):
    configs = check_tiny_folder(request.getfixturevalue(fixture), pipeline_class, family, {"resolution": 32, **areas})
    assert configs["transformer"]["joint_attention_dim"] == TEXT_WIDTH
    vision = configs["text_encoder"]["vision_config"]
    assert (vision["patch_size"], vision["spatial_merge_size"]) == (VISION_PATCH, VISION_MERGE)


def test_the_reference_area_is_whole_packed_latents():
    side = REFERENCE_AREA**0.5
    assert side == 64 and side % (4 * 2) == 0  # VAE factor 4, 2x2 packing: 16 x 16 latents, 64 tokens
