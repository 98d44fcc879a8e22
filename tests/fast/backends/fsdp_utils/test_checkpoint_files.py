"""What a checkpoint holds on disk, without pickled code: JSON + safetensors trees (round trip, refusals naming the
entry, damage naming the file), RNG streams, the manifest's sizes and CRC32s, the model identity and its mismatch in
words, and a DCP metadata reader that refuses code without running it."""

from __future__ import annotations

import json
import os
import pickle
import random
import zlib

import numpy as np
import pytest
import torch
from torch import nn

from miles.backends.fsdp_utils.checkpoint_files import (
    MANIFEST_FILE,
    CheckpointError,
    check_sizes,
    checksum_file,
    describe_files,
    encode_tree,
    identity_mismatch,
    list_files,
    model_identity,
    read_dcp_metadata,
    read_manifest,
    read_tree,
    rng_state,
    set_rng_state,
    verify_checksums,
    write_tree,
)


def test_a_tree_of_data_and_tensors_comes_back_as_it_was_saved(tmp_path):
    tree = {
        "ema": {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)},
        "pair": (1, "x", None),
        "keys": np.arange(3, dtype=np.int64),
        "step": np.int64(4),
        "list": [1.5, True, {"nested": torch.zeros(1)}],
    }
    stem = str(tmp_path / "extra")
    write_tree(encode_tree(tree, "extra"), stem)
    back = read_tree(stem)
    assert back["pair"] == (1, "x", None) and back["step"] == 4 and back["list"][:2] == [1.5, True]
    assert torch.equal(back["ema"]["w"], tree["ema"]["w"]) and back["ema"]["b"].dtype == torch.bfloat16
    assert torch.equal(back["keys"], torch.arange(3)) and torch.equal(back["list"][2]["nested"], torch.zeros(1))
    write_tree(encode_tree({"epoch": 1}, "data"), str(tmp_path / "data"))
    assert read_tree(str(tmp_path / "data")) == {"epoch": 1} and not os.path.exists(tmp_path / "data.safetensors")


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"hook": print}, r"extra\['hook'\] holds a builtin_function_or_method .*never pickled objects"),
        ({1: "x"}, r"extra has non-string keys \[1\]"),
        ({"a": [{"__tensor__": "t0"}]}, r"extra\['a'\]\[0\] uses a reserved key"),
        ({"s": {1, 2}}, r"extra\['s'\] holds a set"),
    ],
)
def test_what_is_not_data_is_refused_naming_the_entry(tree, message):
    with pytest.raises(TypeError, match=message):
        encode_tree(tree, "extra")


def test_a_damaged_tree_is_named(tmp_path):
    stem = str(tmp_path / "extra")
    write_tree(encode_tree({"w": torch.ones(2)}, "extra"), stem)
    with open(f"{stem}.safetensors", "r+b") as f:
        f.write(b"\xff" * 8)  # the header's length
    with pytest.raises(CheckpointError, match=r"extra\.safetensors is damaged"):
        read_tree(stem)
    os.remove(f"{stem}.safetensors")
    with pytest.raises(CheckpointError, match=r"extra\.json refers to tensor 't0', which its \.safetensors lacks"):
        read_tree(stem)
    with open(f"{stem}.json", "w") as f:
        f.write('{"w": ')
    with pytest.raises(CheckpointError, match=r"extra\.json is damaged \(not valid JSON"):
        read_tree(stem)


def test_rng_streams_set_back_repeat_the_same_draws(tmp_path):
    session = rng_state()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1))
    write_tree(encode_tree(state, "rng"), str(tmp_path / "rng"))  # as a save stores them: no pickled tuples
    set_rng_state(read_tree(str(tmp_path / "rng")))
    assert (random.random(), np.random.rand()) == first[:2] and torch.equal(torch.rand(1), first[2])
    set_rng_state(session)  # the session's streams as they were


def test_the_manifest_lists_sizes_and_crc32s_and_names_each_fault(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / "__0_0.distcp").write_bytes(b"shard bytes")
    (tmp_path / "extra.json").write_text("{}")
    (tmp_path / MANIFEST_FILE).write_text("")
    names = list_files(str(tmp_path), skip=(MANIFEST_FILE,))
    assert names == [os.path.join("dcp", "__0_0.distcp"), "extra.json"]
    files = describe_files(str(tmp_path), names)
    assert files["extra.json"] == {"size": 2, "crc32": f"{zlib.crc32(b'{}'):08x}"}
    assert checksum_file(str(tmp_path / "extra.json")) == files["extra.json"]["crc32"]
    with pytest.raises(CheckpointError, match=r"manifest\.json is damaged"):
        read_manifest(str(tmp_path))
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"algorithm": "crc32", "files": files}))
    manifest = read_manifest(str(tmp_path))
    check_sizes(str(tmp_path), manifest, names)
    verify_checksums(str(tmp_path), manifest, names)
    with pytest.raises(CheckpointError, match=r"rng_rank0\.json is not listed in .*manifest\.json"):
        check_sizes(str(tmp_path), manifest, ["rng_rank0.json"])
    (tmp_path / "extra.json").write_text("{ }")
    with pytest.raises(CheckpointError, match=r"extra\.json has 3 bytes, but manifest\.json lists 2"):
        check_sizes(str(tmp_path), manifest, ["extra.json"])
    (tmp_path / "extra.json").write_text("[]")
    with pytest.raises(
        CheckpointError, match=r"extra\.json is damaged: its CRC32 is [0-9a-f]{8}, manifest\.json lists"
    ):
        verify_checksums(str(tmp_path), manifest, ["extra.json"])
    os.remove(tmp_path / "extra.json")
    with pytest.raises(CheckpointError, match=r"extra\.json is missing \(listed in manifest\.json\)"):
        check_sizes(str(tmp_path), manifest, ["extra.json"])
    os.remove(tmp_path / MANIFEST_FILE)
    with pytest.raises(CheckpointError, match="has no manifest.json: it was not written by this version of miles"):
        read_manifest(str(tmp_path))


class Blocks(nn.Module):
    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.config = {"num_layers": num_layers, "dim": 4, "_private": object()}
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(num_layers))


def test_a_models_identity_names_its_class_config_and_size_and_what_differs():
    identity = model_identity(Blocks(2))
    assert identity["class"] == "Blocks" and identity["config"] == {"num_layers": 2, "dim": 4}
    assert identity["num_parameters"] == 40 and identity_mismatch(identity, model_identity(Blocks(2))) is None
    assert identity_mismatch(model_identity(Blocks(3)), identity) == (
        "it holds a Blocks, num_layers=3, 60 parameters but the current model is a Blocks, num_layers=2, "
        "40 parameters (config: num_layers 3 vs 2)"
    )
    renamed = {**identity, "shapes_crc32": "00000000"}
    assert identity_mismatch(renamed, identity).endswith("(parameter names or shapes differ)")
    assert "records no model" in identity_mismatch(None, identity)


class _Touch:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_dcp_metadata_that_asks_for_code_or_is_not_dcp_is_refused_without_running(tmp_path):
    path, marker = tmp_path / ".metadata", tmp_path / "code_ran"
    path.write_bytes(pickle.dumps(_Touch(str(marker))))
    with pytest.raises(CheckpointError, match=r"\.metadata asks to load (builtins|io)\.open: refused"):
        read_dcp_metadata(str(path))
    assert not marker.exists()
    path.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointError, match=r"\.metadata holds a dict, not DCP metadata"):
        read_dcp_metadata(str(path))
    path.write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata is damaged \(UnpicklingError"):
        read_dcp_metadata(str(path))
