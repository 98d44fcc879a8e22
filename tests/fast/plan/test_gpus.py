"""The GPUs a plan is measured against (miles/plan/gpus.py): known names at nvidia-smi's sizes, sizes in GiB, and the
reserve kept free on each."""

from __future__ import annotations

import pytest

from miles.plan.gpus import CONTEXT_RESERVE_BYTES, GIB, MIB, GpuSpec, gpu_spec


def test_a_known_name_has_nvidia_smis_size_in_any_case_and_spacing():
    assert gpu_spec("h100-80gb") == GpuSpec("h100-80gb", 81559 * MIB)
    assert gpu_spec("  H200-141GB ") == GpuSpec("h200-141gb", 143771 * MIB)


@pytest.mark.parametrize(("value", "name", "size"), [("80", "80 GiB", 80 * GIB), ("24.5", "24.5 GiB", int(24.5 * GIB))])
def test_a_size_in_gib_is_a_gpu_of_that_size(value, name, size):
    assert gpu_spec(value) == GpuSpec(name, size)


@pytest.mark.parametrize("value", ["0", "-8", "80gb", "h100", ""])
def test_anything_else_is_refused_naming_the_known_gpus(value):
    with pytest.raises(
        ValueError, match=rf"--plan-gpu {value!r}: use one of h100-80gb, h200-141gb, .* or a size in GiB"
    ):
        gpu_spec(value)


def test_the_reserve_is_the_context_plus_5_percent_and_the_rest_is_usable():
    gpu = gpu_spec("80")
    assert gpu.reserve_bytes == int(1.5 * GIB) + int(0.05 * 80 * GIB) == CONTEXT_RESERVE_BYTES + 4 * GIB
    assert gpu.usable_bytes == 80 * GIB - gpu.reserve_bytes == int(74.5 * GIB)
