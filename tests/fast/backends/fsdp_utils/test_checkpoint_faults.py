"""Damaged, foreign and code-carrying checkpoints are refused, naming the file, on every rank together."""

from __future__ import annotations

import json
import os
import pickle
from datetime import timedelta

import pytest

from miles.backends.fsdp_utils.checkpoint import checkpoint_dir, load_checkpoint, read_extra, save_checkpoint
from miles.backends.fsdp_utils.checkpoint_files import CheckpointError
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group
from tests.fast.backends.fsdp_utils.checkpoint_fault_workers import (
    build_layered,
    damaged_checkpoint_loads,
    flip_bytes,
    relist,
)
from tests.fast.backends.fsdp_utils.fsdp_workers import run_ranks


@pytest.fixture(scope="module")
def world_of_one():
    init_process_group(0, 1, "127.0.0.1", find_free_port(), "cpu", timeout=timedelta(seconds=60))
    yield
    destroy_process_group()


@pytest.fixture
def saved(world_of_one, tmp_path):
    trainer = build_layered(3)
    save_checkpoint(str(tmp_path), 1, "actor", extra={"epoch": 2}, **trainer)
    return str(tmp_path), checkpoint_dir(str(tmp_path), 1, "actor"), trainer


class _Touch:
    """Unpickling this calls open(marker, "w"): a stand-in for any code a crafted pickle would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_code_pickle_is_refused_without_running(saved, tmp_path):
    save_dir, role_dir, trainer = saved
    marker = tmp_path / "code_ran"
    with open(os.path.join(role_dir, "dcp", ".metadata"), "wb") as f:  # the one pickle DCP reads
        pickle.dump(_Touch(str(marker)), f)
    relist(role_dir, "dcp/.metadata")  # crafted with a matching manifest: only the unpickler stands in the way
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata asks to load (builtins|io)\.open: refused"):
        load_checkpoint(save_dir, "actor", rollout_id=1, **trainer)
    assert not marker.exists()


def test_an_old_style_pickle_in_the_folder_is_never_read(saved, tmp_path):
    save_dir, role_dir, trainer = saved
    marker = tmp_path / "code_ran"
    with open(os.path.join(role_dir, "extra.pt"), "wb") as f:  # where miles used to keep `extra`
        pickle.dump(_Touch(str(marker)), f)
    assert load_checkpoint(save_dir, "actor", rollout_id=1, **trainer).extra == {"epoch": 2}
    assert read_extra(save_dir, 1, "actor") == {"epoch": 2}
    assert not marker.exists()


def test_flipped_bytes_in_a_shard_fail_naming_the_file(saved):
    save_dir, role_dir, trainer = saved
    flip_bytes(os.path.join(role_dir, "dcp", "__0_0.distcp"))
    with pytest.raises(
        CheckpointError, match=r"dcp/__0_0\.distcp is damaged: its CRC32 is [0-9a-f]{8}, manifest"
    ) as info:
        load_checkpoint(save_dir, "actor", rollout_id=1, **trainer)
    assert info.value.__notes__ == [f"while loading the actor checkpoint {role_dir}"]


def test_skipping_checksums_still_checks_sizes(saved):
    save_dir, role_dir, trainer = saved
    shard = os.path.join(role_dir, "dcp", "__0_0.distcp")
    flip_bytes(shard)  # the documented trade-off: flipped tensor bytes load when checksums are skipped
    load_checkpoint(save_dir, "actor", rollout_id=1, verify_checksums=False, **trainer)
    with open(shard, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp has \d+ bytes, but manifest\.json lists \d+"):
        load_checkpoint(save_dir, "actor", rollout_id=1, verify_checksums=False, **trainer)


def test_damaged_extra_and_missing_manifest_are_named(saved):
    save_dir, role_dir, trainer = saved
    flip_bytes(os.path.join(role_dir, "extra.json"), count=2)
    with pytest.raises(CheckpointError, match=r"extra\.json is damaged"):
        read_extra(save_dir, 1, "actor")
    os.remove(os.path.join(role_dir, "manifest.json"))
    with pytest.raises(CheckpointError, match=r"has no manifest\.json: it was not written by this version of miles"):
        load_checkpoint(save_dir, "actor", rollout_id=1, **trainer)


def test_another_models_checkpoint_is_refused_up_front_naming_both(saved):
    save_dir, role_dir, _ = saved
    with open(os.path.join(role_dir, "meta.json")) as f:
        assert json.load(f)["model"]["config"] == {"num_layers": 3, "dim": 8}
    smaller = build_layered(2)
    with pytest.raises(
        CheckpointError,
        match=r"refusing to load this actor checkpoint: it holds a LayeredModel, num_layers=3, 216 parameters but the "
        r"current model is a LayeredModel, num_layers=2, 144 parameters \(config: num_layers 3 vs 2\)",
    ):
        load_checkpoint(save_dir, "actor", rollout_id=1, **smaller)


@pytest.fixture(scope="module")
def two_rank_faults(tmp_path_factory):
    return run_ranks(damaged_checkpoint_loads, 2, str(tmp_path_factory.mktemp("ckpt_faults")), timeout=120.0)


def test_a_rank_that_cannot_load_fails_every_rank_together(two_rank_faults):
    for rank, report in enumerate(two_rank_faults):
        kind, message = report["garbage_rng"]
        assert kind == "CheckpointError", (rank, message)
        assert "loading the actor checkpoint" in message and "failed on rank 0" in message
        assert "rng_rank0.json is damaged" in message
        assert report["garbage_rng_s"] < 30  # no rank waits in a collective for the one that failed


def test_a_damaged_shard_is_named_on_every_rank(two_rank_faults):
    for report in two_rank_faults:
        kind, message = report["flipped_shard"]
        assert kind == "CheckpointError" and "failed on rank 1" in message
        assert "dcp/__1_0.distcp is damaged: its CRC32" in message
        assert report["intact"] is None  # the same save, undamaged, loads
