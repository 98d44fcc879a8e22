"""The Wan folders' family base beyond the contract suite: which experts train, the options and their errors,
guidance_scale_2, saving both experts, the σ grid of real (UniPC) folders, latent geometry and video media (the
two experts' routing: test_experts.py; a wan run's start-up checks: test_wan.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import UniPCMultistepScheduler

from miles.algorithms import ALGORITHMS
from miles.arguments.parser import default_args
from miles.models import get_train_pipeline_config
from miles.models.builtin import resolve_checkpoint
from miles.models.diffusers_family import RUN_DEFAULTS_FILE
from miles.models.media import Media

PROMPTS = ["a red circle", "a blue square", "two green triangles"]


def test_guidance_scale_2_guides_the_low_noise_rows_only(tiny_wan_2_experts_dir):
    plain = get_train_pipeline_config(tiny_wan_2_experts_dir, num_frames=5)
    second = get_train_pipeline_config(tiny_wan_2_experts_dir, num_frames=5, guidance_scale_2=1.5)
    experts = plain.load_transformer()
    latents = torch.randn(2, *plain.latent_shape(32), generator=torch.Generator().manual_seed(1))
    sigmas, embeds = torch.tensor([0.95, 0.5]), plain.encode_prompts(PROMPTS[:2])
    with torch.no_grad():
        a = plain.predict_velocity(
            experts, latents, sigmas, embeds, guidance_scale=4.0, negative=plain.encode_negative(1)
        )
        b = second.predict_velocity(
            experts, latents, sigmas, embeds, guidance_scale=4.0, negative=second.encode_negative(1)
        )
    assert torch.equal(a[0], b[0]) and (a[1] - b[1]).abs().max().item() > 1e-4


@pytest.mark.parametrize(("trained", "frozen"), [("high-noise", "transformer_2"), ("low-noise", "transformer")])
def test_trained_experts_freezes_the_other_expert(tiny_wan_2_experts_dir, trained, frozen):
    experts = get_train_pipeline_config(tiny_wan_2_experts_dir, trained_experts=trained).load_transformer()
    for name in ("transformer", "transformer_2"):
        flags = {p.requires_grad for p in getattr(experts, name).parameters()}
        assert flags == {name != frozen}, (name, flags)
    both = get_train_pipeline_config(tiny_wan_2_experts_dir).load_transformer()
    assert all(p.requires_grad for p in both.parameters())


def test_options_are_checked_against_the_folder(tiny_wan_dir, tiny_wan_2_experts_dir, tiny_pipeline_dir):
    with pytest.raises(ValueError, match="--wan-trained-experts low-noise: .* has one expert"):
        get_train_pipeline_config(tiny_wan_dir, trained_experts="low-noise")
    with pytest.raises(ValueError, match="--diffusion-guidance-scale-2 .* has one expert"):
        get_train_pipeline_config(tiny_wan_dir, guidance_scale_2=3.0)
    with pytest.raises(ValueError, match=r"--num-frames 6: .* e\.g\. 5 or 9"):
        get_train_pipeline_config(tiny_wan_dir, num_frames=6)
    moving = resolve_checkpoint("builtin:tiny-moving-shapes")  # temporal factor 1, temporal patch 5
    with pytest.raises(ValueError, match=r"--num-frames 4: its 4 latent frames do not split into the transformer's "
                       r"temporal patches of 5 .*: e\.g\. --num-frames 5 or 10"):  # fmt: skip
        get_train_pipeline_config(moving, num_frames=4)  # the forward failed with a reshape of 0 elements
    assert get_train_pipeline_config(moving, num_frames=10).latent_shape()[1] == 10
    with pytest.raises(ValueError, match="--num-frames does not apply to the sd3 family"):
        get_train_pipeline_config(tiny_pipeline_dir, num_frames=5)
    assert get_train_pipeline_config(tiny_pipeline_dir, num_frames=None).name == "sd3"  # not given: fine
    lora = default_args(use_lora=True)
    get_train_pipeline_config(tiny_wan_dir).check_run_args(lora, ALGORITHMS["policy_loss"])  # one expert: LoRA is fine
    with pytest.raises(ValueError, match="--use-lora with a two-expert Wan folder"):
        get_train_pipeline_config(tiny_wan_2_experts_dir).check_run_args(lora, ALGORITHMS["policy_loss"])


def test_save_transformer_writes_both_experts(tiny_wan_2_experts_dir, tmp_path):
    family = get_train_pipeline_config(tiny_wan_2_experts_dir)
    experts = family.load_transformer()
    with torch.no_grad():
        experts.transformer_2.proj_out.bias.add_(1.0)  # a change only the second expert holds
    out = family.save_transformer(experts.state_dict(), str(tmp_path / "hf"))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(p.name for p in Path(family.path).iterdir())
    reloaded = family.load_transformer(out)
    for key, value in experts.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    with pytest.raises(ValueError, match="neither expert"):
        family.save_transformer({"proj_out.bias": torch.zeros(1)}, str(tmp_path / "bad"))


def test_saved_dtypes_name_every_entry_of_both_experts_as_save_transformer_takes_them(tiny_wan_2_experts_dir):
    family = get_train_pipeline_config(tiny_wan_2_experts_dir)
    state = family.load_transformer().state_dict()
    dtypes = family.saved_transformer_dtypes()
    assert set(dtypes) == set(state) and any(k.startswith("transformer_2.") for k in dtypes)
    for sub in ("transformer", "transformer_2"):  # read independently, from the safetensors headers
        for name, dtype in family.checkpoint_dtypes(Path(family.path) / sub).items():
            assert dtypes[f"{sub}.{name}"] == dtype


def test_real_folders_sample_on_the_unipc_flow_grid(tiny_wan_dir, tmp_path):
    """Real Wan folders ship UniPCMultistepScheduler(use_flow_sigmas, flow_shift): miles samples its σ grid."""
    folder = tmp_path / "unipc"
    shutil.copytree(tiny_wan_dir, folder)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0, num_train_timesteps=1000
    )
    scheduler.save_config(str(folder / "scheduler"))
    family = get_train_pipeline_config(str(folder))
    sigmas = family.sampling_sigmas(50)
    scheduler.set_timesteps(50)
    assert torch.equal(sigmas, scheduler.sigmas.float()) and sigmas.shape == (51,)
    assert abs(float(sigmas[0]) - (1 - 1e-6)) < 1e-7 and float(sigmas[-1]) == 0.0
    assert family.scheduler_shift == 5.0
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, "use_flow_sigmas": False}))
    with pytest.raises(ValueError, match="without use_flow_sigmas"):
        get_train_pipeline_config(str(folder)).sampling_sigmas(4)


def test_latent_geometry_and_video_media(tiny_wan_dir, tmp_path):
    family = get_train_pipeline_config(tiny_wan_dir, num_frames=5)
    assert family.latent_shape(32) == (4, 2, 4, 4)
    assert get_train_pipeline_config(tiny_wan_dir).latent_shape() == (4, 2, 4, 4)  # its miles_defaults.json: 5 at 32
    real = tmp_path / "real"  # the folder as a real one comes, without miles' run defaults: WanPipeline's
    real.mkdir()
    for child in Path(tiny_wan_dir).iterdir():
        if child.name != RUN_DEFAULTS_FILE:
            (real / child.name).symlink_to(child)
    assert get_train_pipeline_config(str(real)).latent_shape() == (4, 21, 60, 60)  # 81 frames at 480
    with pytest.raises(ValueError, match="multiple of 16"):
        family.latent_shape(40)
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    still = family.encode_images(images)  # images become still clips of num_frames frames
    assert still.shape == (2, 4, 2, 4, 4) and still.dtype == torch.float32
    frames = images[:, None].expand(-1, 5, -1, -1, -1)
    assert torch.equal(family.encode_images(frames), still)
    with pytest.raises(ValueError, match=r"\(B, 5, 3, H, W\) frames"):
        family.encode_images(frames[:, :4])
    media = family.decode_latents(still)
    assert isinstance(media, Media) and media.is_video and media.fps == 16.0
    assert media.pixels.shape == (2, 5, 3, 32, 32) and 0.0 <= float(media.pixels.min()) <= float(media.pixels.max())
