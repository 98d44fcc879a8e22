"""Cached prompt encodings (`--prompt-cache`): each prompt's (and negative prompt's) conditioning rows on disk as
safetensors, keyed by a digest of everything that computes them, read back instead of running the text encoders.

`encoder_fingerprint` digests the folder's encoder files, the family's code and options and the dtype; an engine adds
its device (`device_signature`) to get the key of its entries. Every entry is checked on read (key, row, checksum of
its bytes): a stale or damaged one is recomputed and rewritten, never used."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles.models.base import TrainPipelineConfig
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import own_storage

logger = logging.getLogger(__name__)

CACHE_FORMAT = "1"  # bump when the entry layout or what a key covers changes: older entries become misses
OFF, AUTO = "off", "auto"
DEFAULT_SUBDIR = "prompt_cache"  # under --output-dir, for --prompt-cache auto
DIGESTS_FILE = "file_digests.json"  # the encoder files' digests by (path, size, mtime): hashed once per machine
LIBRARIES = ("torch", "transformers", "diffusers", "tokenizers")
_CHUNK = 1 << 24


@dataclass(frozen=True)
class PromptCacheConfig:
    """Where the entries live and the digest of the text encoders that compute them (device aside): what the driver
    hands each engine."""

    directory: str
    fingerprint: str


# hooks that may draw prompts the start-up cannot list: with one, the engines keep their text encoders
DRAWING_HOOKS = (
    "data_source_path",
    "dynamic_sampling_filter_path",
    "rollout_function_path",
    "custom_generate_function_path",
)


def caches_prompts(args: argparse.Namespace, family: TrainPipelineConfig) -> bool:
    """Whether `--prompt-cache` is on for this family (`prompt_cache_config` without its folder)."""
    return args.prompt_cache != OFF and (args.prompt_cache != AUTO or family.prompt_cache_exact)


def frees_text_encoders(args: argparse.Namespace, family: TrainPipelineConfig) -> bool:
    """Whether the engines free their text encoders after the start-up's cache fill (`RolloutManager.fill_prompt_cache`):
    a prompt cache, prompts without source images, and no hook that draws prompts of its own."""
    drawing = any(getattr(args, dest) for dest in DRAWING_HOOKS)
    return caches_prompts(args, family) and not family.takes_source_images and not drawing


def prompt_cache_config(
    args: argparse.Namespace, family: TrainPipelineConfig, dtype: torch.dtype
) -> PromptCacheConfig | None:
    """`--prompt-cache` resolved for this family: None when off. `auto` caches where the cache is exact (the
    family's `prompt_cache_exact`), in OUTPUT_DIR/prompt_cache; a folder caches there, on any family."""
    value = args.prompt_cache
    if value == OFF:
        return None
    if not caches_prompts(args, family):
        logger.info(
            "prompt cache off: the %s family encodes a prompt differently alone and in a batch (in the last bits), so "
            "cached encodings would change the samples; --prompt-cache DIR caches anyway",
            family.name,
        )
        return None
    directory = os.path.join(args.output_dir, DEFAULT_SUBDIR) if value == AUTO else value
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"--prompt-cache {directory}: not a folder (give a folder, auto or off)")
    if not family.prompt_cache_exact:
        logger.warning(
            "--prompt-cache %s with the %s family: each prompt is encoded alone, which differs in the last bits "
            "from its encoding in a batch; the samples are not bit-identical to an uncached run's",
            directory,
            family.name,
        )
    os.makedirs(directory, exist_ok=True)
    started = time.perf_counter()
    fingerprint = encoder_fingerprint(family, dtype, directory)
    logger.info("prompt cache in %s (encoders' digest in %.1fs)", directory, time.perf_counter() - started)
    return PromptCacheConfig(directory, fingerprint)


def encoder_fingerprint(family: TrainPipelineConfig, dtype: torch.dtype, directory: str | None = None) -> str:
    """A digest of what turns a prompt (and its source images) into conditioning, the device aside: every file of the
    pipeline folder but the transformers' (the encoders' weights, tokenizers, processors, the VAE that encodes source
    images), the family's code (its classes' source files), options and dtype, and the library versions. With
    `directory`, file digests are remembered there by (path, size, mtime) so large encoders are hashed once."""
    root = Path(family.path).resolve()
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and not p.relative_to(root).parts[0].startswith("transformer")
    )
    digests = _FileDigests(Path(directory, DIGESTS_FILE) if directory else None)
    identity = {
        "format": CACHE_FORMAT,
        "family": f"{type(family).__module__}.{type(family).__qualname__}",
        "options": {k: repr(v) for k, v in sorted(family.family_options.items())},
        "dtype": str(dtype),
        "files": {str(p.relative_to(root)): digests.of(p) for p in files},
        "code": {cls.__qualname__: digests.of(Path(f)) for cls, f in _family_sources(type(family))},
        "libraries": {name: _version(name) for name in LIBRARIES},
    }
    digests.save()
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def device_signature(device: torch.device) -> str:
    """What besides the encoder changes its output bits on `device`: the GPU model and TF32 switches on CUDA, the
    intra-op thread count on CPU (CPU kernels split their sums by thread)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        return f"cuda:{torch.cuda.get_device_name(index)}:cc{torch.cuda.get_device_capability(index)}:tf32{tf32}"
    return f"{device.type}:threads{torch.get_num_threads()}"


def row_digest(key: str, kind: str, text: str, images: list[np.ndarray] | None = None) -> str:
    """The digest of one conditioning row: the cache key, `kind` (prompt / negative), the text and the source images
    (shape, dtype and bytes of each)."""
    h = hashlib.sha256(f"{key}\0{kind}\0{len(text)}\0{text}".encode())
    for image in images or ():
        array = np.ascontiguousarray(image)
        h.update(f"\0{array.shape}{array.dtype}\0".encode())
        h.update(array.tobytes())
    return h.hexdigest()


class PromptCache:
    """The entries of one key (an encoder fingerprint on one device) under `directory`: one safetensors file per
    conditioning row, written atomically (a temporary file renamed), checked on every read."""

    def __init__(self, directory: str, key: str) -> None:
        self.root = Path(directory, key[:24])
        self.key = key

    def path(self, row: str) -> Path:
        return self.root / row[:2] / f"{row}.safetensors"

    def load(self, row: str) -> Conditioning | None:
        """The entry of `row` on the CPU, or None when there is none or it cannot be trusted (a warning says why:
        another key or row, a truncated or corrupted file)."""
        path = self.path(row)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in json.loads(meta.get("names", "[]"))}
        except Exception as exc:  # noqa: BLE001 - a damaged file raises what its damage makes of it
            logger.warning("prompt cache entry %s is damaged (%s): encoding it again", path, exc)
            return None
        problem = _entry_problem(meta, self.key, row, tensors)
        if problem is not None:
            logger.warning("prompt cache entry %s is not trusted (%s): encoding it again", path, problem)
            return None
        return Conditioning(tensors)

    def store(self, row: str, cond: Conditioning, text: str) -> None:
        """Write `cond` (one row, any device) as the entry of `row`, replacing any entry there at once."""
        tensors = {name: own_storage(value.detach().to("cpu").contiguous()) for name, value in cond.items()}
        meta = {
            "format": CACHE_FORMAT,
            "key": self.key,
            "row": row,
            "names": json.dumps(list(tensors)),
            "checksum": tensors_checksum(tensors),
            "text": text[:200],  # for a person reading the file
        }
        path = self.path(row)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{row[:8]}-", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over each tensor's name, dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for name, value in tensors.items():
        h.update(f"{name}\0{value.dtype}\0{tuple(value.shape)}\0".encode())
        h.update(value.contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return h.hexdigest()


def _entry_problem(meta: dict[str, str], key: str, row: str, tensors: dict[str, torch.Tensor]) -> str | None:
    if meta.get("format") != CACHE_FORMAT:
        return f"format {meta.get('format')!r}, expected {CACHE_FORMAT}"
    if meta.get("key") != key or meta.get("row") != row:
        return "it was written for another encoder or prompt"
    if not tensors:
        return "it holds no tensors"
    if tensors_checksum(tensors) != meta.get("checksum"):
        return "its tensors do not match their checksum"
    return None


def _family_sources(cls: type) -> list[tuple[type, str]]:
    """(class, source file) of the family class and its bases up to `TrainPipelineConfig`."""
    out = []
    for base in cls.__mro__:
        if base is object or not issubclass(base, TrainPipelineConfig):
            continue
        try:
            out.append((base, inspect.getsourcefile(base)))
        except TypeError:  # a class defined without a file (interactively): its name only
            continue
    return [(c, f) for c, f in out if f]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


class _FileDigests:
    """sha256 of files, remembered in a JSON file by (resolved path, size, mtime_ns)."""

    def __init__(self, memo: Path | None) -> None:
        self.memo, self.known, self.changed = memo, {}, False
        if memo is not None and memo.is_file():
            try:
                self.known = json.loads(memo.read_text())
            except (OSError, ValueError):  # a damaged memo is only a slower start: hash again
                self.known = {}

    def of(self, path: Path) -> str:
        stat = path.stat()
        name, stamp = str(path.resolve()), [stat.st_size, stat.st_mtime_ns]
        entry = self.known.get(name)
        if isinstance(entry, list) and entry[:2] == stamp:
            return entry[2]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        self.known[name], self.changed = [*stamp, h.hexdigest()], True
        return h.hexdigest()

    def save(self) -> None:
        if self.memo is None or not self.changed:
            return
        fd, tmp = tempfile.mkstemp(dir=self.memo.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.known, f)
        os.replace(tmp, self.memo)
