"""The plan against `torch.cuda.max_memory_allocated` (scripts/gpu_check_plan.py): SD3.5-Medium at 1024 px, full
fine-tuning with bf16 master weights, world size 1, random weights; every phase within 10%."""

import argparse

import pytest

pytestmark = pytest.mark.gpu


def test_the_sd35_medium_plan_is_within_10_percent_of_max_memory_allocated(load_script, tmp_path):
    plan_script = load_script("scripts/gpu_check_plan.py")
    opts = argparse.Namespace(model="sd3.5-medium", device="cuda", workdir=str(tmp_path))
    result, passed = plan_script.plan_vs_measured(opts)
    assert passed, result
    assert "plan / max_memory_allocated" in result
