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


def test_a_family_without_empty_loads_whole_with_a_warning(tiny_pipeline_dir, caplog):
    import torch

    from miles.backends.fsdp_utils.sharded_load import load_sharded
    from miles.models.sd3.sd3 import SD3PipelineConfig

    class OldStyle(SD3PipelineConfig):  # a user family written before `empty`
        def load_transformer(self, path=None, dtype=torch.float32):
            return super().load_transformer(path, dtype)

    family = OldStyle(tiny_pipeline_dir)
    calls = []
    model = load_sharded(
        family, None, dtype=torch.float32, device=torch.device("cpu"), shard=calls.append, prepare=calls.append
    )
    assert calls == [model, model]  # prepared, then sharded, as the sharded path does
    assert "takes no `empty`" in caplog.text
    expected = SD3PipelineConfig(tiny_pipeline_dir).load_transformer().state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
