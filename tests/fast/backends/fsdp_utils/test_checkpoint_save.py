"""The steps of a save on one rank: `meta` checked before anything is written, the role folder emptied of a former
save's files by rank 0 only, the state written (DCP shards, this rank's RNG, rank 0's LR schedule and `extra`), the
manifest of every file but itself and meta.json, and the meta.json record with the caller's keys last."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from miles import __version__
from miles.backends.fsdp_utils.checkpoint_files import encode_tree, model_identity, read_manifest, read_tree
from miles.backends.fsdp_utils.checkpoint_save import (
    check_meta_argument,
    meta_record,
    prepare_role_dir,
    write_manifest,
    write_state,
)
from miles.backends.fsdp_utils.checkpoint_space import SaveTarget


def test_meta_may_not_take_a_key_miles_writes_and_must_be_json():
    check_meta_argument(None)
    check_meta_argument({"global_step": 3, "loss_type": "nft"})
    with pytest.raises(ValueError, match=r"meta keys \['model', 'time'\] are reserved \(miles writes \['rollout_id'"):
        check_meta_argument({"time": 0, "model": "x"})
    with pytest.raises(TypeError, match="meta must be JSON-serialisable for meta.json"):
        check_meta_argument({"weights": torch.zeros(1)})


def test_rank_0_empties_a_resaved_role_folder_and_the_others_only_make_it(tmp_path):
    role = tmp_path / "iter_0000001" / "actor"
    prepare_role_dir(str(role), rank=1)
    assert role.is_dir()
    (role / "meta.json").write_text("{}")
    (role / "dcp").mkdir()
    (role / "dcp" / "__0_0.distcp").write_bytes(b"x")
    prepare_role_dir(str(role), rank=1)
    assert sorted(os.listdir(role)) == ["dcp", "meta.json"]  # another rank leaves what is there
    prepare_role_dir(str(role), rank=0)
    assert os.listdir(role) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP saves in this one process
def test_the_state_and_its_manifest_on_rank_0_and_only_the_rng_elsewhere(tmp_path):
    state = {"model": {"w": torch.arange(4.0)}}
    schedule, extra = encode_tree({"last_epoch": 3}, "lr_scheduler"), encode_tree({"epoch": 1}, "extra")
    write_state(str(tmp_path), 0, state, schedule, extra)
    target = SaveTarget("--save", str(tmp_path), 1, str(tmp_path), 1, None)
    write_manifest(str(tmp_path), 0, 1, target)
    names = set(read_manifest(str(tmp_path)))
    assert {"rng_rank0.json", "rng_rank0.safetensors", "lr_scheduler.json", "extra.json"} <= names
    assert any(n.startswith("dcp" + os.sep) for n in names) and "manifest.json" not in names
    assert read_tree(str(tmp_path / "extra")) == {"epoch": 1}
    other = tmp_path / "rank1"
    write_state(str(other), 1, state, schedule, extra)
    assert {n for n in os.listdir(other) if not n.startswith("dcp")} == {"rng_rank1.json", "rng_rank1.safetensors"}


def test_meta_json_records_the_save_the_model_and_the_frozen_digest_then_the_callers_keys():
    model = nn.Linear(3, 2)
    frozen = {"tensors": 0, "elements": 0, "words": 0}
    record = json.loads(meta_record(4, "critic", 2, model, frozen, {"global_step": 9}))
    assert (record["rollout_id"], record["role"], record["world_size"]) == (4, "critic", 2)
    assert record["miles_version"] == __version__ and record["time"]
    assert record["model"] == model_identity(model) and record["frozen_weights"] == frozen
    assert list(record)[-1] == "global_step" and record["global_step"] == 9
