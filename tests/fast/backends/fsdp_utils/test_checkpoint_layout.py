"""Where a checkpoint's parts lie: the iteration and role folders, the RNG file of a rank, the rank helpers outside
a process group, the atomic text write (a failed write leaves the old text whole and no temporary file), and
meta.json read back or refused naming what is wrong."""

from __future__ import annotations

import json
import os

import pytest

from miles.backends.fsdp_utils import checkpoint_layout
from miles.backends.fsdp_utils.checkpoint_layout import (
    REQUIRED_META,
    SET_TRAINED,
    TRAINED_ONLY,
    atomic_write_text,
    barrier,
    checkpoint_dir,
    current_rank,
    current_world_size,
    read_meta,
    rng_stem,
)


def test_the_folders_and_the_rank_files_are_named_by_iteration_role_and_rank():
    assert checkpoint_dir("/s", 12, "critic") == os.path.join("/s", "iter_0000012", "critic")
    assert rng_stem(3) == "rng_rank3"
    assert (current_rank(), current_world_size(), barrier()) == (0, 1, None)  # no process group: one rank
    assert TRAINED_ONLY.ignore_frozen_params and SET_TRAINED.ignore_frozen_params and not SET_TRAINED.strict


def test_an_atomic_write_replaces_whole_or_leaves_the_old_text(tmp_path, monkeypatch):
    path = str(tmp_path / "latest.txt")
    atomic_write_text(path, "1\n")
    atomic_write_text(path, "2\n")
    assert open(path).read() == "2\n" and os.listdir(tmp_path) == ["latest.txt"]

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_layout.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "3\n")
    assert open(path).read() == "2\n" and os.listdir(tmp_path) == ["latest.txt"]  # no temporary file left


def test_meta_json_is_read_back_or_refused_naming_the_file_and_the_fault(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no meta.json: the save did not finish; load an earlier"):
        read_meta(str(tmp_path))
    meta = tmp_path / "meta.json"
    record = {key: 1 for key in REQUIRED_META}
    meta.write_text(json.dumps({**record, "global_step": 7}))
    assert read_meta(str(tmp_path))["global_step"] == 7
    meta.write_text('{"rollout_id": 1,')
    with pytest.raises(ValueError, match=r"meta\.json is corrupt \(not valid JSON"):
        read_meta(str(tmp_path))
    meta.write_text(json.dumps({"rollout_id": 1, "role": "actor"}))
    with pytest.raises(ValueError, match=r"corrupt: missing fields \['world_size', 'miles_version', 'time'\]"):
        read_meta(str(tmp_path))
    meta.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"missing fields \['rollout_id', 'role'"):
        read_meta(str(tmp_path))
