"""Sharded loading (`sharded_load.load_sharded`): built on the meta device, each rank reads only its rows, and the
shards, buffers, dtypes and LoRA initialisation equal what from_pretrained on every rank plus `fully_shard` gives."""

from __future__ import annotations

import json

import pytest

from tests.fast.backends.fsdp_utils.fsdp_workers import run_ranks
from tests.fast.backends.fsdp_utils.sharded_load_workers import compare_loads


@pytest.fixture(scope="module")
def reports(tiny_pipeline_dir, tiny_wan_2_experts_dir, tiny_flux_dev_dir, tmp_path_factory) -> dict[int, list[dict]]:
    out = tmp_path_factory.mktemp("sharded_load")
    cases = [
        {"name": "sd3", "path": tiny_pipeline_dir, "dtype": "float32", "lora": False},
        {"name": "sd3_lora", "path": tiny_pipeline_dir, "dtype": "float32", "lora": True},
        {"name": "wan_2_experts_bf16", "path": tiny_wan_2_experts_dir, "dtype": "bfloat16", "lora": False},
        {"name": "flux_dev", "path": tiny_flux_dev_dir, "dtype": "float32", "lora": False},
    ]
    (out / "cases.json").write_text(json.dumps(cases))
    return {3: run_ranks(compare_loads, 3, str(out), timeout=240.0)}


@pytest.mark.parametrize("case", ["sd3", "sd3_lora", "wan_2_experts_bf16", "flux_dev"])
def test_sharded_load_equals_from_pretrained_then_fully_shard(reports, case):
    for rank, report in enumerate(reports[3]):
        r = report[case]
        assert r["keys_equal"], (rank, case)
        assert r["different"] == [], (rank, case, r["different"][:5])
        assert r["dtype_mismatch"] == [], (rank, case, r["dtype_mismatch"][:5])
        assert r["meta_left"] == [], (rank, case)
    assert reports[3][0]["sd3_lora"]["lora_entries"] > 0
