"""The diffusers families' shared base (miles/models/diffusers_family.py): class names resolved in diffusers on use,
the checks every velocity and geometry needs, tensors made safe to save, the run defaults a folder records, the
safetensors dtypes of a model folder, and the σ grids of the schedulers that shift by resolution."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import save_file

from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    RUN_DEFAULTS_FILE,
    DiffusersFamily,
    calculate_shift_args,
    check_velocity_inputs,
    diffusers_class,
    dynamic_sampling_shift,
    dynamic_shift_sigmas,
    own_storage,
    square_latent_side,
    training_shift,
    unit_range,
    write_run_defaults,
)
from miles.models.flux.flux import FluxPipelineConfig

FLUX_SCHEDULER = {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "shift": 3.0}


def test_a_class_name_is_resolved_in_diffusers_and_a_class_is_itself():
    assert diffusers_class("FluxTransformer2DModel") is FluxTransformer2DModel
    assert diffusers_class(torch.nn.Linear) is torch.nn.Linear


def test_a_velocity_needs_one_sigma_and_one_conditioning_row_per_latent():
    cond = Conditioning({"prompt_embeds": torch.zeros(2, 3)})
    check_velocity_inputs(torch.zeros(2, 4), torch.zeros(2), cond)
    with pytest.raises(ValueError, match=r"sigmas must have shape \(2,\), got \(1,\)"):
        check_velocity_inputs(torch.zeros(2, 4), torch.zeros(1), cond)
    with pytest.raises(ValueError, match="embeds batch 2 != latents batch 3"):
        check_velocity_inputs(torch.zeros(3, 4), torch.zeros(3), cond)


def test_a_square_frames_latent_side_and_a_resolution_it_cannot_take():
    assert square_latent_side(64, 8, 16, "VAE factor x packing") == 8
    with pytest.raises(ValueError, match=r"resolution 40 must be a multiple of 16 \(VAE factor x packing\)"):
        square_latent_side(40, 8, 16, "VAE factor x packing")


def test_a_view_into_a_larger_storage_is_copied_and_a_whole_tensor_kept():
    whole = torch.arange(10.0)
    assert own_storage(whole) is whole
    part = own_storage(whole[:4])
    assert part.untyped_storage().nbytes() == 16 and torch.equal(part, whole[:4])
    save_file({"part": part}, "/dev/null")  # safetensors refuses a view of a larger storage


def test_decoded_pixels_map_to_the_unit_range():
    assert unit_range(torch.tensor([-3.0, -1.0, 0.0, 1.0, 2.0], dtype=torch.bfloat16)).tolist() == [0, 0, 0.5, 1, 1]


def test_a_folders_run_defaults_and_its_weights_dtypes(tiny_flux_dev_dir, tmp_path):
    import shutil

    folder = shutil.copytree(tiny_flux_dev_dir, tmp_path / "pipeline")
    family = FluxPipelineConfig(str(folder))
    assert family.folder_default("resolution") is None  # none recorded: the pipeline's own apply
    write_run_defaults(folder, resolution=48, num_frames=5)
    assert (folder / RUN_DEFAULTS_FILE).is_file()
    assert FluxPipelineConfig(str(folder)).folder_default("resolution") == 48
    save_file({"a": torch.zeros(1, dtype=torch.bfloat16), "b": torch.zeros(1)}, str(tmp_path / "w.safetensors"))
    assert DiffusersFamily.checkpoint_dtypes(tmp_path) == {"a": torch.bfloat16, "b": torch.float32}
    with pytest.raises(FileNotFoundError, match="has no .safetensors weights"):
        DiffusersFamily.checkpoint_dtypes(folder)  # the pipeline folder itself holds none at its top


def test_shifts_of_static_and_dynamic_schedulers():
    assert training_shift({"shift": 3.0}) == 3.0 and training_shift(FLUX_SCHEDULER) == 1.0
    assert dynamic_sampling_shift({"shift": 3.0}, mu=0.7) == 3.0
    assert dynamic_sampling_shift(FLUX_SCHEDULER, mu=0.7) == pytest.approx(math.exp(0.7))
    assert dynamic_sampling_shift({**FLUX_SCHEDULER, "time_shift_type": "linear"}, mu=0.7) == 0.7
    with pytest.raises(ValueError, match="time_shift_type 'cubic' is not one diffusers defines"):
        dynamic_sampling_shift({**FLUX_SCHEDULER, "time_shift_type": "cubic"}, mu=0.7)
    assert calculate_shift_args({}) == (256, 4096, 0.5, 1.15)
    assert calculate_shift_args({"base_image_seq_len": 64, "max_shift": 0.9}) == (64, 4096, 0.5, 0.9)


def test_the_dynamic_grid_is_unshifted_t_through_the_static_shift_of_mu_then_zero():
    sigmas = dynamic_shift_sigmas(FLUX_SCHEDULER, 4, mu=0.7)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (5,) and sigmas[-1] == 0
    t, s = torch.linspace(1, 1 / 4, 4), dynamic_sampling_shift(FLUX_SCHEDULER, 0.7)
    torch.testing.assert_close(sigmas[:-1], s * t / (1 + (s - 1) * t))
    static = dynamic_shift_sigmas({"shift": 1.0}, 2, mu=5.0)  # no dynamic shifting: mu is not used
    torch.testing.assert_close(static, torch.tensor([1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="num_steps must be >= 1, got 0"):
        dynamic_shift_sigmas(FLUX_SCHEDULER, 0, mu=0.7)
