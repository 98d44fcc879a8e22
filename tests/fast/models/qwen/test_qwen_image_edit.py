"""What the Qwen-Image-Edit families add to the contract suite: the tiny tokenizer drops the edit template's system
part as the real one does, the reference size is the pipeline's megapixel on a real folder, what the family refuses,
and that batches padded to one prompt length predict as they did alone; for Qwen-Image-Edit-Plus, its two image sizes,
its one to three images per prompt (a record with more fails at start-up naming FILE:LINE), and batches whose rows'
references differ. Pipeline parity is in `test_family_contract.py`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image

from miles.arguments.parser import parse_args
from miles.models import get_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.rollout.data_source import PromptDataError
from miles.startup import startup_checks
from tests.fast.models.pipeline_layouts import qwen_edit_reference_area


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


# Qwen-Image-Edit-Plus (QwenImageEditPlusPipeline, 2509): one to three source images per prompt


@pytest.fixture(scope="module")
def plus(tiny_qwen_image_edit_plus_dir):
    return get_train_pipeline_config(tiny_qwen_image_edit_plus_dir)


def _smooth(width: int, height: int, seed: int) -> np.ndarray:
    """A seeded (height, width, 3) uint8 colour ramp (a VAE encodes it to more than noise)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0.3, 1.0, width)[None, :, None] * np.linspace(1.0, 0.5, height)[:, None, None]
    return np.clip(rng.uniform(0, 255, (1, 1, 3)) * ramp + rng.uniform(-20, 20, (height, width, 3)), 0, 255).astype(
        np.uint8
    )


def test_plus_template_and_its_two_image_sizes(plus, tmp_path):
    pipe = plus.text_pipeline()
    template = pipe.prompt_template_encode  # the images come as "Picture k: ..." before the prompt
    assert len(pipe.tokenizer(template[: template.index("{}")]).input_ids) == pipe.prompt_template_encode_start_idx
    assert pipe.prompt_template_encode_start_idx == 64
    assert plus.name == "qwen-image-edit-plus" and plus.source_image_range == (1, 3) and plus.negative_per_prompt
    # the tiny folder's areas: the VL encoder's copy, the VAE's copy and the output all differ in size
    assert (plus.condition_size(32, 32), plus.reference_size(32, 32)) == ((96, 96), (64, 64))
    folder = Path(shutil.copytree(plus.path, tmp_path / "real", ignore=shutil.ignore_patterns("*.safetensors")))
    (folder / "miles_defaults.json").unlink()
    real = type(plus)(str(folder))  # a real folder: the pipeline's 384² and one megapixel
    assert (real.condition_size(512, 512), real.reference_size(512, 512)) == ((384, 384), (1024, 1024))
    assert real.condition_size(640, 480) == calculate_dimensions(384 * 384, 640 / 480)[:2]
    assert real.reference_size(640, 480) == calculate_dimensions(1024 * 1024, 640 / 480)[:2]


def test_plus_takes_one_to_three_images_and_a_record_with_more_fails_at_start_up_naming_it(plus, tmp_path):
    with pytest.raises(ValueError, match="edits source images: encode_prompts needs images="):
        plus.encode_prompts(["a circle"])
    with pytest.raises(ValueError, match=r"takes 1 to 3 source image\(s\) per prompt, got prompts with 4"):
        plus.encode_request(["a circle"], [[_smooth(32, 32, k) for k in range(4)]], "", negative=False)
    (tmp_path / "img").mkdir()
    for k in range(4):
        Image.fromarray(_smooth(32, 32, k)).save(tmp_path / "img" / f"{k}.png")
    rows = [
        {"prompt": "put the circle of picture 1 on picture 2", "images": ["img/0.png", "img/1.png"]},
        {"prompt": "make the square red", "image": "img/2.png"},
        {"prompt": "join the four", "images": [f"img/{k}.png" for k in range(4)]},
    ]
    data = tmp_path / "edits.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = parse_args(["--hf-checkpoint", plus.path, "--prompt-data", str(data), "--output-dir", str(tmp_path / "out"),
                       "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--eval-interval", "0"])  # fmt: skip
    with pytest.raises(PromptDataError, match=r"edits\.jsonl:3: 4 source image\(s\); this model takes 1 to 3 per"):
        startup_checks(args)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    startup_checks(args)  # one and two images: accepted


def test_plus_rows_whose_references_differ_run_apart_and_each_is_the_pipelines(plus):
    """Prompt 1's second image is wide: its reference grid differs from its first's and from the other rows', so the
    batch runs in two forwards; each row predicts as it does alone, and prompt 1's is what the pipeline steps with."""
    prompts = ["put the circle of picture 1 on picture 2", "a blue square", "make the two red"]
    images = [
        [_smooth(32, 32, 0), _smooth(32, 32, 1)],
        [_smooth(32, 32, 2), _smooth(64, 16, 3)],
        [_smooth(32, 32, 4), _smooth(32, 32, 5)],
    ]
    embeds, negative = plus.encode_request(prompts, images, "", negative=True)
    assert embeds["image_shapes"].tolist() == [[[8, 8], [8, 8]], [[8, 8], [4, 16]], [[8, 8], [8, 8]]]
    assert negative.batch_size == 3 and not torch.equal(negative["prompt_embeds"][0], negative["prompt_embeds"][2])
    pipe = QwenImageEditPlusPipeline.from_pretrained(plus.path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    steps = []
    pipe.scheduler.step = lambda velocity, t, sample, *a, **k: steps.append((velocity, sample)) or (sample,)
    with qwen_edit_reference_area(plus.path):
        pipe(image=[Image.fromarray(i) for i in images[1]], prompt=prompts[1], negative_prompt="", true_cfg_scale=3.5,
             height=32, width=32, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
             output_type="latent")  # fmt: skip
    unpack = lambda packed: pipe._unpack_latents(packed, 32, 32, pipe.vae_scale_factor)[:, :, 0]  # noqa: E731
    velocity, sample = (unpack(t) for t in steps[0])  # the first step (one step: σ is NaN under shift_terminal)
    latents = torch.randn(3, *plus.latent_shape(32), generator=torch.Generator().manual_seed(1))
    latents[1] = sample[0]
    sigmas = torch.full((3,), float(pipe.scheduler.sigmas[0]))
    transformer = plus.load_transformer()
    with torch.no_grad():
        batch = plus.predict_velocity(transformer, latents, sigmas, embeds, guidance_scale=3.5, negative=negative)
        alone = [
            plus.predict_velocity(
                transformer, latents[[i]], sigmas[[i]], embeds.rows(i), guidance_scale=3.5, negative=negative.rows(i)
            )  # fmt: skip
            for i in range(3)
        ]
    torch.testing.assert_close(batch, torch.cat(alone), atol=1e-5, rtol=0)
    assert (batch[1] - velocity[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("plus", [False, True])
def test_under_the_planners_fake_tensors_the_prompts_encode_to_the_real_shapes(
    family, tiny_qwen_image_edit_plus_dir, plus
):
    """The vision tower sizes its tokens from the values of each image's patch grid, which fake tensors do not hold
    (every plan of these families failed): under the simulation the processor runs for real and the encoder stands in
    by shape, one prompt at a time. Same shapes and dtypes as the real encoding, prompts of different lengths
    padded alike."""
    from torch._subclasses.fake_tensor import FakeTensor

    from miles.plan.fake import PlanTensorMode

    fam = get_train_pipeline_config(tiny_qwen_image_edit_plus_dir) if plus else family
    prompts, images = ["make it red", "two blue squares on the left, then a yellow circle"], _images(2)
    real = fam.encode_prompts(prompts, images=images)
    with PlanTensorMode():
        fake = fam.encode_prompts(prompts, images=images)
    assert isinstance(fake["prompt_embeds"], FakeTensor)
    for name in ("prompt_embeds", "prompt_embeds_mask", "image_latents"):
        assert (fake[name].shape, fake[name].dtype) == (real[name].shape, real[name].dtype), name
    assert fam.encode_prompts(prompts, images=images)["prompt_embeds"].equal(real["prompt_embeds"])  # real again
