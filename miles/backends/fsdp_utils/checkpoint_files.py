"""What a checkpoint holds on disk, without pickled code: JSON + safetensors trees, the checksum manifest, the model
identity, RNG streams, and a DCP reader that refuses anything but DCP's own metadata classes."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import zlib
from collections.abc import Iterable, Mapping
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.fsdp import FSDPModule

MANIFEST_FILE = "manifest.json"
CHUNK_BYTES = 16 << 20  # zlib releases the GIL per call: hashing runs beside the DCP load


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: damaged, foreign, unsafe or incomplete; the message names the file."""


# ---- trees of JSON data and tensors -------------------------------------------------------------
def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return _encode(torch.from_numpy(np.ascontiguousarray(obj)), tensors, where)
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where} has non-string keys {bad[:3]}: checkpoints hold JSON data and tensors only")
        if "__tensor__" in obj or "__tuple__" in obj:
            raise TypeError(f"{where} uses a reserved key (__tensor__ / __tuple__)")
        return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in obj.items()}
    raise TypeError(
        f"{where} holds a {type(obj).__name__} ({obj!r}): checkpoints hold JSON data (dict, list, str, numbers) and "
        "tensors only, never pickled objects"
    )


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor], path: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, path) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            if obj["__tensor__"] not in tensors:
                raise CheckpointError(f"{path} refers to tensor {obj['__tensor__']!r}, which its .safetensors lacks")
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"}:
            return tuple(_decode(v, tensors, path) for v in obj["__tuple__"])
        return {k: _decode(v, tensors, path) for k, v in obj.items()}
    return obj


def encode_tree(obj: Any, where: str) -> tuple[str, dict[str, torch.Tensor]]:
    """(JSON text, tensors) for a tree of dicts / lists / tuples / scalars / tensors; TypeError names the bad entry."""
    tensors: dict[str, torch.Tensor] = {}
    return json.dumps(_encode(obj, tensors, where)), tensors


def write_tree(encoded: tuple[str, dict[str, torch.Tensor]], stem: str) -> None:
    """`stem.json`, plus `stem.safetensors` when the tree holds tensors."""
    text, tensors = encoded
    if tensors:
        save_file(tensors, f"{stem}.safetensors")
    with open(f"{stem}.json", "w") as f:
        f.write(text)


def read_tree(stem: str) -> Any:
    """The tree `write_tree` wrote; a damaged file fails naming it."""
    json_path, tensor_path = f"{stem}.json", f"{stem}.safetensors"
    try:
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{json_path} is damaged (not valid JSON: {err})") from None
    tensors: dict[str, torch.Tensor] = {}
    if os.path.isfile(tensor_path):
        try:
            tensors = load_file(tensor_path)
        except Exception as err:  # safetensors raises its own error types for a bad header
            raise CheckpointError(f"{tensor_path} is damaged ({err})") from None
    return _decode(data, tensors, json_path)


# ---- RNG streams as JSON data and tensors -------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This rank's RNG streams as JSON data and tensors (no pickled tuples or arrays)."""
    version, internal, gauss = random.getstate()
    # the legacy tuple (get_state's default), which numpy's stubs type together with the dict form
    name, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- the manifest: size and CRC32 of every file ---------------------------------------------
def checksum_file(path: str) -> str:
    """CRC32 of a file (zlib's, ~4 GB/s on one core here; blake2b ~0.9, sha256 ~1.7)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def list_files(root: str, skip: Iterable[str] = ()) -> list[str]:
    """Every file under `root` as a sorted list of relative paths, minus `skip`."""
    skipped, out = set(skip), []
    for folder, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), root)
            if rel not in skipped:
                out.append(rel)
    return sorted(out)


def describe_files(root: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {name: {"size": os.path.getsize(os.path.join(root, name)), "crc32": checksum_file(os.path.join(root, name))}
            for name in names}  # fmt: skip


def read_manifest(root: str) -> dict[str, dict[str, Any]]:
    path = os.path.join(root, MANIFEST_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{root} has no {MANIFEST_FILE}: it was not written by this version of miles (older checkpoints held "
            "pickled files, which are no longer loaded); re-create it with a current miles"
        )
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is damaged ({err!r})") from None
    return files


def check_sizes(root: str, manifest: Mapping[str, Mapping[str, Any]], names: Iterable[str]) -> None:
    """Cheap: every named file is listed, present and of the listed size."""
    for name in names:
        path = os.path.join(root, name)
        if name not in manifest:
            raise CheckpointError(f"{path} is not listed in {os.path.join(root, MANIFEST_FILE)}")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing (listed in {MANIFEST_FILE})")
        size = os.path.getsize(path)
        if size != manifest[name]["size"]:
            raise CheckpointError(f"{path} has {size} bytes, but {MANIFEST_FILE} lists {manifest[name]['size']}")


def verify_checksums(root: str, manifest: Mapping[str, Mapping[str, Any]], names: Iterable[str]) -> None:
    for name in names:
        got = checksum_file(os.path.join(root, name))
        if got != manifest[name]["crc32"]:
            raise CheckpointError(
                f"{os.path.join(root, name)} is damaged: its CRC32 is {got}, {MANIFEST_FILE} lists "
                f"{manifest[name]['crc32']} (flipped bytes or a partial copy)"
            )


# ---- the model a checkpoint belongs to ------------------------------------------------------
def model_identity(model: torch.nn.Module) -> dict[str, Any]:
    """Class, public config (diffusers models: num_layers, ...), parameter count and a digest of names and shapes:
    enough to refuse another model's checkpoint up front, naming both."""
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # fully_shard subclasses it
    config = getattr(model, "config", None)
    public = {}
    if isinstance(config, Mapping):
        for key, value in config.items():
            if not key.startswith("_"):
                try:
                    public[key] = json.loads(json.dumps(value))
                except (TypeError, ValueError):
                    public[key] = repr(value)
    shapes = sorted(f"{name}:{tuple(p.shape)}" for name, p in model.named_parameters())
    return {
        "class": cls.__name__,
        "config": public,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "shapes_crc32": f"{zlib.crc32(chr(10).join(shapes).encode()):08x}",
    }


def _summary(identity: Mapping[str, Any]) -> str:
    config = identity.get("config") or {}
    layers = f", num_layers={config['num_layers']}" if "num_layers" in config else ""
    return f"{identity.get('class')}{layers}, {identity.get('num_parameters')} parameters"


def identity_mismatch(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str | None:
    """None when `saved` (from meta.json) describes the same model as `current`; else both, and what differs."""
    if saved is None:
        return "meta.json records no model (a checkpoint not written by this version of miles)"
    if dict(saved) == dict(current):
        return None
    saved_config, current_config = saved.get("config") or {}, current.get("config") or {}
    diffs = [
        f"{key} {saved_config.get(key)!r} vs {current_config.get(key)!r}"
        for key in sorted(set(saved_config) | set(current_config))
        if saved_config.get(key) != current_config.get(key)
    ]
    detail = f" (config: {'; '.join(diffs)})" if diffs else " (parameter names or shapes differ)"
    return f"it holds a {_summary(saved)} but the current model is a {_summary(current)}{detail}"


# ---- DCP without pickled code ---------------------------------------------------------------
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_SAFE_GLOBALS = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("torch", "Size"),
                 ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes, torch sizes / dtypes and paths: a crafted `.metadata` cannot run code."""

    def __init__(self, file: io.BufferedReader, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.path} asks to load {module}.{name}: refused (checkpoints may not hold code)")


def read_dcp_metadata(path: str) -> Any:
    """DCP's `.metadata` through `_MetadataUnpickler`; anything else in it is refused naming the file."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{path} is damaged ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read by `_MetadataUnpickler` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = read_dcp_metadata(str(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer hyper-parameters) through `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
