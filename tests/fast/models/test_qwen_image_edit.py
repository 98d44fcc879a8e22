"""What the Qwen-Image-Edit family adds to the contract suite: the tiny tokenizer drops the edit template's system part
as the real one does, the reference size is the pipeline's megapixel on a real folder, what the family refuses, and
that batches padded to one prompt length predict as they did alone. Pipeline parity is in `test_family_contract.py`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

from miles.models import get_train_pipeline_config
from miles.models.conditioning import Conditioning


@pytest.fixture(scope="module")
def family(tiny_qwen_image_edit_dir):
    return get_train_pipeline_config(tiny_qwen_image_edit_dir)


def _images(count: int, side: int = 32, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 256, (side, side, 3), dtype=np.uint8)] for _ in range(count)]


def test_tokenizer_splits_the_edit_template_system_part_into_the_tokens_the_pipeline_drops(family):
    pipe = family.text_pipeline()
    template = pipe.prompt_template_encode
    system_part = template[: template.index("<|vision_start|>")]
    assert len(pipe.tokenizer(system_part).input_ids) == pipe.prompt_template_encode_start_idx == 64


def test_reference_size_is_the_pipelines_megapixel_without_a_folder_default(family, tmp_path):
    assert family.reference_size(32, 32) == (64, 64)  # the tiny folder's area
    folder = Path(shutil.copytree(family.path, tmp_path / "real", ignore=shutil.ignore_patterns("*.safetensors")))
    (folder / "miles_defaults.json").unlink()
    real = type(family)(str(folder))
    assert real.reference_size(512, 512) == calculate_dimensions(1024 * 1024, 1.0)[:2] == (1024, 1024)
    assert real.reference_size(640, 480) == calculate_dimensions(1024 * 1024, 640 / 480)[:2]


def test_source_images_are_required_one_per_prompt_and_of_one_size(family):
    with pytest.raises(ValueError, match="edits a source image: encode_prompts needs images="):
        family.encode_prompts(["a circle"])
    with pytest.raises(ValueError, match="takes 1 source image"):
        family.encode_request(["a circle"], None, "", negative=False)
    with pytest.raises(ValueError, match="takes 1 source image.*got prompts with 2"):
        family.encode_request(["a circle"], [_images(2)[0] + _images(1)[0]], "", negative=False)
    mixed = _images(1, side=32) + _images(1, side=64)
    with pytest.raises(ValueError, match="first one's shape.*resize them to one size"):
        family.encode_prompts(["a circle", "a square"], images=mixed)


def test_negative_is_one_text_row_per_prompt_read_with_its_image(family):
    images = _images(2)
    embeds, negative = family.encode_request(["a circle", "a circle"], images, "", negative=True)
    assert family.negative_per_prompt and negative.batch_size == 2
    assert list(negative) == ["prompt_embeds", "prompt_embeds_mask"]
    assert not torch.equal(negative["prompt_embeds"][0], negative["prompt_embeds"][1])  # the images differ
    assert embeds["image_latents"].shape == (2, *family.latent_shape(64))  # the 64 x 64 reference


def test_padding_to_a_longer_batch_changes_no_velocity(family):
    images = _images(3, seed=1)
    long = family.encode_prompts(["two red circles on the left", "a blue square"], images=images[:2])
    short = family.encode_prompts(["a circle"], images=images[2:])
    both = Conditioning.cat([short, long])
    assert both["prompt_embeds_mask"].sum(dim=1).tolist()[0] < both["prompt_embeds"].shape[1]  # padded
    latents = torch.randn(3, *family.latent_shape(32), generator=torch.Generator().manual_seed(0))
    transformer = family.load_transformer()
    with torch.no_grad():
        joined = family.predict_velocity(transformer, latents, torch.full((3,), 0.6), both)
        alone = family.predict_velocity(transformer, latents[:1], torch.full((1,), 0.6), short)
    torch.testing.assert_close(joined[:1], alone, atol=1e-5, rtol=0)


def test_a_guidance_distilled_transformer_is_refused(family, tmp_path):
    folder = Path(shutil.copytree(family.path, tmp_path / "distilled"))
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "guidance_embeds": True}))
    with pytest.raises(ValueError, match="guidance_embeds=True, which QwenImageEditPipeline does not run"):
        type(family)(str(folder)).load_transformer()
