"""The steps of a load on one rank: meta.json against this run (its ranks, its place, its model), the frozen weights'
digest, this rank's small files (RNG, LR schedule only when asked and saved, `extra` only when saved), and the state
DCP fills set back on the model and optimizer."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from miles.backends.fsdp_utils.checkpoint_files import (
    CheckpointError,
    describe_files,
    encode_tree,
    list_files,
    rng_state,
    write_tree,
)
from miles.backends.fsdp_utils.checkpoint_load import (
    check_frozen_weights,
    check_meta,
    read_small_files,
    restore,
    state_to_load,
)
from miles.backends.fsdp_utils.checkpoint_save import meta_record

DIGEST = {"tensors": 2, "elements": 10, "words": 77}


def saved_meta(path, model, **changes):
    record = json.loads(meta_record(3, "actor", 1, model, DIGEST, None))
    (path / "meta.json").write_text(json.dumps({**record, **changes}))


def test_meta_json_must_match_the_place_and_the_model_at_any_world_size(tmp_path):
    model = nn.Linear(4, 2)
    saved_meta(tmp_path, model)
    assert check_meta(str(tmp_path), "actor", 3, model)["rollout_id"] == 3
    with pytest.raises(ValueError, match=r"records rollout 3 role 'actor', but it sits where rollout 4 role 'actor'"):
        check_meta(str(tmp_path), "actor", 4, model)
    with pytest.raises(CheckpointError, match=r"refusing to load this actor checkpoint: it holds a Linear, 10 param"):
        check_meta(str(tmp_path), "actor", 3, nn.Linear(4, 3))
    saved_meta(tmp_path, model, world_size=2)
    assert check_meta(str(tmp_path), "actor", 3, model)["world_size"] == 2  # another world size: DCP reshards


def test_the_frozen_weights_rebuilt_must_be_the_ones_trained_on(tmp_path):
    check_frozen_weights(str(tmp_path), "actor", {}, DIGEST)  # a checkpoint from before the digest: nothing to check
    check_frozen_weights(str(tmp_path), "actor", {"frozen_weights": DIGEST}, dict(DIGEST))
    with pytest.raises(
        CheckpointError,
        match=r"frozen weights \(2 tensors, 10 values, .*\(2 tensors, 10 values, word sum 78 against 77\); resume "
        r"from the same --hf-checkpoint",
    ):
        check_frozen_weights(str(tmp_path), "actor", {"frozen_weights": DIGEST}, {**DIGEST, "words": 78})


def small_files(path, with_schedule=True, with_extra=True):
    write_tree(encode_tree(rng_state(), "rng"), str(path / "rng_rank0"))
    if with_schedule:
        write_tree(encode_tree({"last_epoch": 5}, "lr_scheduler"), str(path / "lr_scheduler"))
    if with_extra:
        write_tree(encode_tree({"epoch": 2}, "extra"), str(path / "extra"))
    return describe_files(str(path), list_files(str(path)))


def test_this_ranks_small_files_are_read_when_listed(tmp_path):
    manifest = small_files(tmp_path)
    rng, schedule, extra = read_small_files(str(tmp_path), manifest, 0, with_schedule=True, verify=True)
    assert torch.equal(rng["torch"], torch.get_rng_state()) and schedule == {"last_epoch": 5} and extra == {"epoch": 2}
    assert read_small_files(str(tmp_path), manifest, 0, with_schedule=False, verify=False)[1] is None
    with pytest.raises(CheckpointError, match=r"rng_rank1\.json is not listed in manifest\.json"):
        read_small_files(str(tmp_path), manifest, 1, with_schedule=False, verify=True)
    bare = tmp_path / "bare"
    bare.mkdir()
    manifest = small_files(bare, with_schedule=False, with_extra=False)
    assert read_small_files(str(bare), manifest, 0, with_schedule=False, verify=True)[2] is None
    with pytest.raises(FileNotFoundError, match=r"lr_scheduler\.json does not exist: .*saved without an LR scheduler"):
        read_small_files(str(bare), manifest, 0, with_schedule=True, verify=True)


def test_the_loaded_state_is_set_back_on_the_model_and_with_the_optimizer_on_it_too():
    saved, model = nn.Linear(3, 2), nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = state_to_load(model, optimizer, None, load_optimizer=False)
    assert set(state) == {"model"}
    state["model"] = {k: v.clone() for k, v in saved.state_dict().items()}  # what DCP would have filled in
    rng = rng_state()
    restore(model, optimizer, None, state, None, rng, load_optimizer=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # AdamW moments to load back
    full = state_to_load(model, optimizer, {"ema": {"w": torch.zeros(1)}}, load_optimizer=True)
    assert set(full) == {"model", "optimizer", "ema"} and full["optimizer"]["state"]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    restore(model, optimizer, scheduler, full, {**scheduler.state_dict(), "last_epoch": 7}, rng, load_optimizer=True)
    assert scheduler.last_epoch == 7
