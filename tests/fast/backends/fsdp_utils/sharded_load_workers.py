"""Rank bodies for the sharded-loading tests: each case's network loaded through `load_sharded` (meta device, then
each rank reads its rows) and the plain way (from_pretrained on every rank, then `fully_shard`), side by side."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from miles.backends.fsdp_utils.fsdp import apply_fsdp2
from miles.backends.fsdp_utils.lora import apply_lora
from miles.backends.fsdp_utils.sharded_load import load_sharded
from miles.models.base import get_train_pipeline_config

LORA = {"r": 2, "lora_alpha": 2.0, "target_modules": ["to_q", "to_k"], "init_lora_weights": True, "lora_dropout": 0.0}


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _shard(family: Any, dtype: torch.dtype):
    return lambda model: apply_fsdp2(
        model, family.transformer_blocks(model), param_dtype=dtype, reduce_dtype=torch.float32, cast_root_inputs=False
    )


def compare_loads(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Per case: the entries whose local shard (or buffer) differs between the two loads, the meta entries left,
    and the dtypes of the sharded load's parameters."""
    with open(os.path.join(out_dir, "cases.json")) as f:
        cases = json.load(f)
    report = {}
    for case in cases:
        family = get_train_pipeline_config(case["path"])
        dtype = getattr(torch, case["dtype"])
        lora = (lambda model: apply_lora(model, LORA)) if case["lora"] else None
        torch.manual_seed(11)
        sharded = load_sharded(
            family, None, dtype=dtype, device=torch.device("cpu"), shard=_shard(family, dtype), prepare=lora
        )
        torch.manual_seed(11)
        plain = family.load_transformer(None, dtype=dtype)
        if lora is not None:
            lora(plain)
        _shard(family, dtype)(plain)
        mine, theirs = sharded.state_dict(), plain.state_dict()
        report[case["name"]] = {
            "keys_equal": list(mine) == list(theirs),
            "different": [n for n, v in mine.items() if n in theirs and not torch.equal(_local(v), _local(theirs[n]))],
            "dtype_mismatch": [n for n, v in mine.items() if n in theirs and v.dtype != theirs[n].dtype],
            "meta_left": [n for n, v in mine.items() if _local(v).is_meta],
            "local_rows": {n: _local(v).shape[0] for n, v in mine.items() if v.dim()},
            "lora_entries": sum("lora_" in n for n in mine),
        }
    return report
