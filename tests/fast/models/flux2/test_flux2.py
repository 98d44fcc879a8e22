"""What the flux2 families add to the contract suite (`test_family_contract.py`: klein and dev, text to image and two
references, guidance 1 and 3.5): text and editing data both run on one folder, and what a run refuses at start-up
(CFG on a step-distilled klein, MixGRPO-Flash, reference images under 64 px, a folder of the other FLUX.2 pipeline, a
negative prompt for dev); FLUX.2 [dev]'s guidance is embedded (no negative), and a folder whose tokenizer is a
PixtralProcessor (as FLUX.2-dev's, which transformers cannot load without torchvision) encodes through its tokenizer
and the processor's chat template (mixed reference counts and the reference checks: test_folder.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.utils import is_torchvision_available

from miles.arguments.parser import default_args, parse_args
from miles.models import get_train_pipeline_config
from miles.rollout.data_source import PromptDataError, read_prompt_file
from miles.startup import startup_checks


@pytest.fixture(scope="module")
def family(tiny_flux2_klein_dir):
    return get_train_pipeline_config(tiny_flux2_klein_dir)


def _image(seed: int, side: int = 64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((side, side), Image.BILINEAR))


def _copy_with_index(source: str, tmp_path: Path, **changes) -> str:
    folder = Path(shutil.copytree(source, tmp_path / "folder", ignore=shutil.ignore_patterns("*.safetensors")))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, **changes}))
    return str(folder)


def test_a_run_takes_text_and_editing_data_and_refuses_what_flux2_does_not_support(tiny_flux2_klein_dir, tmp_path):
    def check(*flags, path=tiny_flux2_klein_dir):
        startup_checks(parse_args(["--hf-checkpoint", path, *flags]))

    check("--loss-type", "nft", "--prompt-data", "builtin:shapes")  # text to image, its shapes eval
    check("--loss-type", "nft", "--prompt-data", "builtin:shapes-edit")
    Image.fromarray(_image(0)).save(tmp_path / "a.png")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        "\n".join(json.dumps(r) for r in [{"prompt": "a red circle"}, {"prompt": "make it blue", "image": "a.png"}])
    )
    check(
        "--eval-interval", "0", "--prompt-data", str(mixed), "--allow-repeated-prompts"
    )  # records with and without references
    (tmp_path / "prompts.txt").write_text("a red circle\na blue square\n")
    check("--eval-interval", "0", "--prompt-data", str(tmp_path / "prompts.txt"), "--allow-repeated-prompts")
    with pytest.raises(ValueError, match="--mixgrpo-flash is not supported by the flux2 family"):
        check("--loss-type", "policy_loss", "--mixgrpo-window-size", "4", "--mixgrpo-flash", "--eval-interval", "0")
    with pytest.raises(ValueError, match="--resolution 32: the flux2 family loads reference images"):
        check("--resolution", "32", "--eval-interval", "0")
    distilled = _copy_with_index(tiny_flux2_klein_dir, tmp_path, is_distilled=True)
    check("--eval-interval", "0", "--diffusion-guidance-scale", "1.0", path=distilled)
    with pytest.raises(ValueError, match="--diffusion-guidance-scale 3.5 with the step-distilled"):
        check("--eval-interval", "0", "--diffusion-guidance-scale", "3.5", path=distilled)
    with pytest.raises(ValueError, match="--dmd2-real-guidance-scale 4.5 with the step-distilled"):
        check("--loss-type", "dmd2", "--eval-interval", "0", "--teacher-load", distilled, path=distilled)
    shutil.rmtree(distilled)
    with pytest.raises(ValueError, match=r"is a Flux2KleinPipeline folder; the flux2-dev family covers Flux2Pipeline "
                       r"\(FLUX.2 \[dev\]\) folders only"):  # fmt: skip
        get_train_pipeline_config(tiny_flux2_klein_dir, "flux2-dev")


def test_prompt_records_without_images_are_text_prompts_for_a_family_that_takes_0(tmp_path):
    """A JSONL for flux2 may mix text-to-image records with editing ones; for a family that needs an image the same
    record is refused naming the line."""
    Image.fromarray(_image(0)).save(tmp_path / "a.png")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "a red circle"}) + "\n" + json.dumps({"prompt": "blue", "image": "a.png"}))
    args = default_args(input_key="prompt", metadata_key="metadata", source_image_range=(0, 10))
    records = read_prompt_file(str(mixed), args, source_images=True)
    assert "source_images" not in records[0] and records[1]["source_images"] == [str(tmp_path / "a.png")]
    args.source_image_range = (1, 1)
    with pytest.raises(PromptDataError, match=r"mixed\.jsonl:1: no source image"):
        read_prompt_file(str(mixed), args, source_images=True)


def test_flux2_dev_embeds_its_guidance_and_refuses_what_its_pipeline_lacks(tiny_flux2_dev_dir, tiny_flux2_klein_dir):
    """Flux2Pipeline is guidance-distilled: w is the transformer's guidance input at every w (1 too), one forward
    without a negative (a negative given is not read); it has no negative prompt, so a run's is refused."""
    family = get_train_pipeline_config(tiny_flux2_dev_dir)
    assert family.name == "flux2-dev" and family.text_encoder_out_layers == (1, 2, 3)  # the tiny folder's
    embeds, negative = family.encode_request(["a red circle"], [[_image(1)]], "", negative=True)
    transformer = family.load_transformer()
    latents = torch.randn(1, *family.latent_shape(64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        velocity = {w: family.predict_velocity(transformer, latents, torch.tensor([0.7]), embeds, guidance_scale=w)
                    for w in (1.0, 4.0)}  # fmt: skip
        with_negative = family.predict_velocity(
            transformer, latents, torch.tensor([0.7]), embeds, guidance_scale=4.0, negative=negative
        )
    assert (velocity[4.0] - velocity[1.0]).abs().max() > 1e-4  # the embedding reads w
    assert torch.equal(with_negative, velocity[4.0])

    def check(*flags):
        startup_checks(parse_args(["--hf-checkpoint", tiny_flux2_dev_dir, "--eval-interval", "0", *flags]))

    check("--diffusion-guidance-scale", "4.0")
    check("--loss-type", "dmd2", "--teacher-load", tiny_flux2_dev_dir)  # the teacher's scale is its embedded w
    with pytest.raises(ValueError, match="--negative-prompt with the flux2-dev family: Flux2Pipeline"):
        check("--negative-prompt", "blurry")
    with pytest.raises(ValueError, match="--mixgrpo-flash is not supported by the flux2-dev family"):
        check("--loss-type", "policy_loss", "--mixgrpo-window-size", "4", "--mixgrpo-flash")
    with pytest.raises(ValueError, match=r"is a Flux2Pipeline folder; the flux2 family covers Flux2KleinPipeline"):
        get_train_pipeline_config(tiny_flux2_dev_dir, "flux2")


def test_a_flux2_dev_folder_with_a_pixtral_processor_encodes_through_its_tokenizer(tiny_flux2_dev_dir, tmp_path):
    """FLUX.2-dev's `tokenizer/` is a PixtralProcessor (model_index names it; its chat template may sit in
    processor_config.json, which wins over the tokenizer's own). The family reads the tokenizer with the processor's
    template and encodes as the tiny folder, whose tokenizer is saved alone; diffusers itself cannot load such a
    folder without torchvision (the reason the family does not load the processor)."""
    folder = Path(shutil.copytree(tiny_flux2_dev_dir, tmp_path / "dev"))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "tokenizer": ["transformers", "PixtralProcessor"]}))
    template = (folder / "tokenizer" / "chat_template.jinja").read_text()
    (folder / "tokenizer" / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[-1]['content'][0]['text'] }}")
    processor = {"processor_class": "PixtralProcessor", "image_token": "[IMG]", "patch_size": 8,
                 "spatial_merge_size": 2, "chat_template": template}  # fmt: skip
    (folder / "tokenizer" / "processor_config.json").write_text(json.dumps(processor))
    prompts = ["two red circles on the left", "a blue square"]
    expected = get_train_pipeline_config(tiny_flux2_dev_dir).encode_prompts(prompts)
    embeds = get_train_pipeline_config(str(folder)).encode_prompts(prompts)
    assert sorted(embeds) == sorted(expected) and all(torch.equal(embeds[k], expected[k]) for k in expected)
    if not is_torchvision_available():
        import diffusers

        with pytest.raises(ValueError, match="processing_pixtral.*Placeholder.* cannot be loaded"):
            diffusers.Flux2Pipeline.from_pretrained(str(folder), local_files_only=True)  # transformers' stand-in
