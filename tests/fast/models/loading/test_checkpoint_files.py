"""An engine's transformer loads without copies (`load_transformer_direct`): the process's peak resident memory while
loading stays within 1.2x the weights it ends up holding, here cast from the checkpoint's fp32 to bf16; the same
measure sees from_pretrained's host copies, and the loaded weights are those from_pretrained loads."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from miles.models.base import get_train_pipeline_config
from miles.models.loading.checkpoint_files import load_transformer_direct


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def load_peak(load) -> tuple[torch.nn.Module, int, int]:
    """(the module, peak resident bytes while loading, resident bytes after), both above the resident set before."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    model = load()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return model, status("VmHWM") - before, status("VmRSS") - before


def held(model: torch.nn.Module) -> int:
    """The bytes of the module's parameters and buffers (those computed at construction too: SD3's position table)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.fixture(scope="module")
def wide_sd3(tmp_path_factory, tiny_pipeline_dir):
    """The tiny SD3 folder with a transformer of 36M parameters (143 MB in fp32): large beside the allocator's noise."""
    from diffusers import SD3Transformer2DModel

    folder = tmp_path_factory.mktemp("wide_sd3") / "pipeline"
    shutil.copytree(tiny_pipeline_dir, folder, ignore=shutil.ignore_patterns("transformer"))
    family = get_train_pipeline_config(tiny_pipeline_dir)
    config = dict(family.load_transformer(empty=True).config)
    config.update(num_layers=4, attention_head_dim=64, num_attention_heads=8, caption_projection_dim=512)
    torch.manual_seed(0)
    SD3Transformer2DModel.from_config(config).save_pretrained(folder / "transformer")
    return str(folder)


@pytest.mark.parametrize("dtype", [torch.bfloat16])  # the cast: fp32 in the file (fp32 reads alike, measured 1.04x)
def test_the_load_peak_stays_within_1_2x_the_resident_weights(wide_sd3, dtype):
    family = get_train_pipeline_config(wide_sd3)
    model, peak, resident = load_peak(lambda: load_transformer_direct(family, dtype=dtype, device="cpu"))
    weights = held(model)
    assert weights > 30e6 and resident >= 0.9 * weights  # read into memory, not mapped from the file for later
    assert peak <= 1.2 * weights, f"load peak {peak / weights:.2f}x the weights"
    reference = family.load_transformer(dtype=dtype)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert not model.training and all(p.dtype == dtype for p in model.parameters())


def test_the_measure_sees_the_copies_of_a_cast_from_pretrained(wide_sd3):
    family = get_train_pipeline_config(wide_sd3)
    model, peak, _ = load_peak(lambda: family.load_transformer(dtype=torch.bfloat16))
    assert peak > 1.5 * held(model)
