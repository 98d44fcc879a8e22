"""Checkpoints: bitwise restore and exact resume on 2 ranks, the on-disk layout, the latest pointer, bad input."""

from __future__ import annotations

import json
import os
import zlib
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

from miles import __version__
from miles.backends.fsdp_utils import checkpoint, checkpoint_layout, checkpoint_save
from miles.backends.fsdp_utils.checkpoint import (
    LATEST_FILE,
    checkpoint_dir,
    load_checkpoint,
    read_latest,
    save_checkpoint,
    write_latest,
)
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group
from tests.fast.backends.fsdp_utils.fsdp_workers import DIM, build_trainer, run_ranks, save_and_resume, snapshot


def assert_bitwise_equal(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), where
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(actual, expected), where
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_bitwise_equal(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bitwise_equal(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> tuple[str, list[dict]]:
    out_dir = str(tmp_path_factory.mktemp("ckpt_ws2"))
    return os.path.join(out_dir, "ckpt"), run_ranks(save_and_resume, 2, out_dir)


@pytest.fixture(scope="module")
def gloo_world_of_one():
    init_process_group(0, 1, "127.0.0.1", find_free_port(), "cpu", timeout=timedelta(seconds=60))
    yield
    destroy_process_group()


@pytest.fixture
def trainer(gloo_world_of_one):
    model, optimizer, scheduler = build_trainer(0)
    return {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler}


@pytest.mark.parametrize("how", ["in_place", "fresh"])
def test_load_restores_the_saved_state_bitwise(two_rank_run, how):
    _, reports = two_rank_run
    for rank, report in enumerate(reports):
        restored, saved = report[f"restored_{how}"], report["saved"]
        assert saved["optimizer"]["state"]  # AdamW moments exist, so they were really compared
        for part in ("params", "optimizer", "scheduler", "rng"):
            assert_bitwise_equal(restored[part], saved[part], f"rank{rank}/{part}")


@pytest.mark.parametrize("how", ["in_place", "fresh"])
def test_step_after_load_equals_the_uninterrupted_step(two_rank_run, how):
    _, reports = two_rank_run
    for report in reports:
        assert not torch.equal(report["uninterrupted"]["head.weight"], report["saved"]["params"]["head.weight"])
        assert_bitwise_equal(report[f"resumed_{how}"], report["uninterrupted"])


def test_ranks_keep_their_own_rng_streams(two_rank_run):
    _, (rank0, rank1) = two_rank_run
    assert not torch.equal(rank0["saved"]["rng"]["torch"], rank1["saved"]["rng"]["torch"])


def test_loaded_checkpoint_reports_rollout_extra_and_meta(two_rank_run):
    _, reports = two_rank_run
    for report in reports:
        loaded = report["loaded"]
        assert loaded["rollout_id"] == 3
        assert_bitwise_equal(
            loaded["extra"], {"ema": {"head.weight": torch.ones(2, DIM)}, "data_source": {"epoch": 1, "offset": 5}}
        )
        meta = loaded["meta"]
        assert (meta["rollout_id"], meta["role"], meta["world_size"]) == (3, "actor", 2)
        assert meta["miles_version"] == __version__ and meta["loss_type"] == "sft_loss" and meta["time"]


def test_load_without_optimizer_only_restores_weights(two_rank_run):
    _, reports = two_rank_run
    for report in reports:
        assert_bitwise_equal(report["weights_only"]["params"], report["saved"]["params"])
        before = report["weights_only_before"]
        assert_bitwise_equal(report["weights_only"]["optimizer"], before["optimizer"])
        assert_bitwise_equal(report["weights_only"]["scheduler"], before["scheduler"])


def test_a_device_full_on_one_rank_fails_every_rank_and_keeps_the_latest(two_rank_run):
    save_dir, ranks = two_rank_run
    for report in ranks:  # rank 1 ran out of space; rank 0 raises the same error instead of waiting for it
        assert report["full_disk"].startswith(
            f"no space left on the device of --save {save_dir} while saving iteration 4 ("
        ), report["full_disk"]
        assert "the latest checkpoint is still iteration 3, intact" in report["full_disk"]
    assert read_latest(save_dir) == 3 and not os.path.exists(os.path.join(save_dir, "iter_0000004"))


def test_layout_on_disk(two_rank_run):
    save_dir, _ = two_rank_run
    role_dir = checkpoint_dir(save_dir, 3, "actor")
    assert role_dir == os.path.join(save_dir, "iter_0000003", "actor")
    rng = {f"rng_rank{r}.{ext}" for r in (0, 1) for ext in ("json", "safetensors")}
    expected = {"dcp", *rng, "lr_scheduler.json", "extra.json", "extra.safetensors", "manifest.json", "meta.json"}
    assert set(os.listdir(role_dir)) == expected  # no .pt: nothing pickled
    assert os.path.isfile(os.path.join(role_dir, "dcp", ".metadata"))
    with open(os.path.join(role_dir, "manifest.json")) as f:
        listed = json.load(f)["files"]
    on_disk = {
        os.path.relpath(os.path.join(folder, name), role_dir)
        for folder, _, names in os.walk(role_dir)
        for name in names
    }
    assert set(listed) == on_disk - {"manifest.json", "meta.json"}
    for name, entry in listed.items():
        with open(os.path.join(role_dir, name), "rb") as f:
            data = f.read()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    assert set(os.listdir(save_dir)) == {LATEST_FILE, "iter_0000003"}  # no temporary file left behind
    with open(os.path.join(save_dir, LATEST_FILE)) as f:
        assert f.read() == "3\n"
    assert read_latest(save_dir) == 3


def test_a_two_rank_checkpoint_loads_into_one_rank_resharded(two_rank_run, trainer, caplog):
    save_dir, (rank0, _) = two_rank_run
    torch.manual_seed(9)
    rng_before = torch.get_rng_state()
    with caplog.at_level("WARNING", logger="miles.backends.fsdp_utils.checkpoint"):
        loaded = load_checkpoint(save_dir, "actor", **trainer)
    assert loaded.rollout_id == 3 and loaded.meta["world_size"] == 2
    restored = snapshot(trainer["model"], trainer["optimizer"], trainer["lr_scheduler"])
    for part in ("params", "optimizer", "scheduler"):  # the full tensors, as both ranks held them at the save
        assert_bitwise_equal(restored[part], rank0["saved"][part], part)
    assert torch.equal(torch.get_rng_state(), rng_before)  # no rank of one holds rank 0's stream of two
    assert "was saved by 2 ranks and loads into 1: parameters, optimizer state and shadows resharded" in caplog.text


def test_missing_directory(tmp_path, trainer):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=f"checkpoint directory {missing} does not exist"):
        load_checkpoint(missing, "actor", **trainer)


def test_missing_latest_file(tmp_path, trainer):
    assert read_latest(str(tmp_path)) is None
    with pytest.raises(FileNotFoundError, match=f"{LATEST_FILE} does not exist"):
        load_checkpoint(str(tmp_path), "actor", **trainer)


def test_latest_pointing_at_missing_iteration(tmp_path, trainer):
    (tmp_path / LATEST_FILE).write_text("9\n")
    with pytest.raises(FileNotFoundError, match=r"points at rollout 9, but .*iter_0000009/actor does not exist"):
        load_checkpoint(str(tmp_path), "actor", **trainer)
    with pytest.raises(FileNotFoundError, match="no critic checkpoint for rollout 4"):
        load_checkpoint(str(tmp_path), "critic", rollout_id=4, **trainer)


def test_garbled_latest_file(tmp_path):
    (tmp_path / LATEST_FILE).write_text("iter_3")
    with pytest.raises(ValueError, match=f"{LATEST_FILE} contains 'iter_3'; expected a rollout id"):
        read_latest(str(tmp_path))


def test_corrupt_meta_json(tmp_path, trainer):
    path = save_checkpoint(str(tmp_path), 1, "actor", **trainer)
    with open(os.path.join(path, "meta.json"), "w") as f:
        f.write('{"rollout_id": 1, "role"')
    with pytest.raises(ValueError, match=r"meta\.json is corrupt \(not valid JSON"):
        load_checkpoint(str(tmp_path), "actor", rollout_id=1, **trainer)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"rollout_id": 1, "role": "actor"}, f)
    with pytest.raises(ValueError, match=r"meta\.json is corrupt: missing fields \['world_size'"):
        load_checkpoint(str(tmp_path), "actor", rollout_id=1, **trainer)


def test_reserved_meta_keys_are_refused(tmp_path, trainer):
    with pytest.raises(ValueError, match=r"meta keys \['world_size'\] are reserved"):
        save_checkpoint(str(tmp_path), 1, "actor", meta={"world_size": 8}, **trainer)
    with pytest.raises(TypeError, match="meta must be JSON-serialisable"):
        save_checkpoint(str(tmp_path), 1, "actor", meta={"weights": torch.zeros(1)}, **trainer)
    assert not os.path.exists(checkpoint_dir(str(tmp_path), 1, "actor"))


def test_extra_that_is_not_data_is_refused_before_writing(tmp_path, trainer):
    with pytest.raises(TypeError, match=r"extra\['hook'\] holds a function .*never pickled objects"):
        save_checkpoint(str(tmp_path), 2, "actor", extra={"hook": lambda: 0}, **trainer)
    assert not os.path.exists(checkpoint_dir(str(tmp_path), 2, "actor"))


def test_failed_save_keeps_the_previous_pointer(tmp_path, trainer, monkeypatch):
    save_dir = str(tmp_path)
    save_checkpoint(save_dir, 1, "actor", **trainer)
    write_latest(save_dir, 1)

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_save, "write_tree", disk_full)  # the save dies half-way, after the DCP shards
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(save_dir, 2, "actor", **trainer)
    monkeypatch.undo()
    assert read_latest(save_dir) == 1
    assert not os.path.exists(os.path.join(save_dir, "iter_0000002"))  # the failed save removed its partial folder
    os.makedirs(os.path.join(save_dir, "iter_0000002", "actor", "dcp"))  # a save killed half-way leaves one
    with pytest.raises(RuntimeError, match=r"unfinished saves for roles \['actor'\] \(no meta\.json\)"):
        write_latest(save_dir, 2)
    with pytest.raises(FileNotFoundError, match="iter_0000002/actor has no meta.json: the save did not finish"):
        load_checkpoint(save_dir, "actor", rollout_id=2, **trainer)
    with pytest.raises(FileNotFoundError, match="no checkpoint in .*iter_0000005"):
        write_latest(save_dir, 5)
    assert read_latest(save_dir) == 1
    assert load_checkpoint(save_dir, "actor", **trainer).rollout_id == 1


def test_pointer_write_is_atomic(tmp_path, trainer, monkeypatch):
    save_dir = str(tmp_path)
    for rollout_id in (1, 2):
        save_checkpoint(save_dir, rollout_id, "actor", **trainer)
    write_latest(save_dir, 1)

    def crash(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_layout.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_latest(save_dir, 2)
    monkeypatch.undo()
    with open(os.path.join(save_dir, LATEST_FILE)) as f:
        assert f.read() == "1\n"  # the old pointer is whole, never half-written
    assert set(os.listdir(save_dir)) == {LATEST_FILE, "iter_0000001", "iter_0000002"}
    write_latest(save_dir, 2)
    assert read_latest(save_dir) == 2


def test_resaving_an_iteration_drops_stale_files(tmp_path, trainer):
    save_dir = str(tmp_path)
    path = save_checkpoint(save_dir, 1, "actor", extra={"epoch": 1}, **trainer)
    save_checkpoint(save_dir, 1, "actor", **{**trainer, "lr_scheduler": None})
    assert not os.path.exists(os.path.join(path, "extra.json"))
    loaded = load_checkpoint(save_dir, "actor", rollout_id=1, **{**trainer, "lr_scheduler": None})
    assert loaded.extra is None
    with pytest.raises(FileNotFoundError, match="saved without an LR scheduler"):
        load_checkpoint(save_dir, "actor", rollout_id=1, **trainer)


def frozen_base_trainer(seed: int) -> dict[str, Any]:
    """A model whose first two blocks are frozen (a LoRA base's part), the optimizer over the rest, as optim.py builds
    it; the frozen values come from `seed`."""
    from tests.fast.backends.fsdp_utils.fsdp_workers import build_fsdp_model

    model = build_fsdp_model(seed)
    for block in list(model.blocks)[:2]:
        block.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return {"model": model, "optimizer": optimizer, "lr_scheduler": None}


def trained_and_frozen(model: torch.nn.Module) -> tuple[dict, dict]:
    values = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    trained = {n: v for n, v in values.items() if dict(model.named_parameters())[n].requires_grad}
    return trained, {n: v for n, v in values.items() if n not in trained}


def test_frozen_weights_are_left_out_and_checked_against_the_rebuilt_model(tmp_path, gloo_world_of_one):
    saved = frozen_base_trainer(seed=7)
    model = saved["model"]
    model(torch.ones(2, DIM)).square().sum().backward()
    saved["optimizer"].step()
    save_checkpoint(str(tmp_path), 1, "actor", **saved)
    trained, frozen = trained_and_frozen(model)

    role_dir = checkpoint_dir(str(tmp_path), 1, "actor")
    stored = set(checkpoint.read_dcp_metadata(os.path.join(role_dir, "dcp", ".metadata")).state_dict_metadata)
    model_keys = {k.removeprefix("model.") for k in stored if k.startswith("model.")}
    assert model_keys == set(trained) and frozen and not set(frozen) & model_keys  # the base is not on disk
    with open(os.path.join(role_dir, "meta.json")) as f:
        digest = json.load(f)["frozen_weights"]
    assert digest["tensors"] == len(frozen) and digest["elements"] == sum(v.numel() for v in frozen.values())

    again = frozen_base_trainer(seed=7)  # the same base rebuilt from its folder, the trained part from the checkpoint
    for p in again["model"].parameters():
        if p.requires_grad:
            p.data.to_local().zero_()
    load_checkpoint(str(tmp_path), "actor", rollout_id=1, **again)
    got_trained, got_frozen = trained_and_frozen(again["model"])
    assert_bitwise_equal(got_trained, trained)
    assert_bitwise_equal(got_frozen, frozen)
    assert again["optimizer"].state  # AdamW's moments came back with the weights

    other_base = frozen_base_trainer(seed=8)
    with pytest.raises(checkpoint.CheckpointError, match=r"its frozen weights \(4 tensors.*same --hf-checkpoint"):
        load_checkpoint(str(tmp_path), "actor", rollout_id=1, **other_base)
