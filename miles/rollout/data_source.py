"""Prompt data: JSONL files, plain-text prompt files (one prompt per line), builtin:shapes or builtin:ocr, served in
seeded epochs; the order is a pure function of rollout id."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles.arguments.records import FlagRecord
from miles.data.moving_shapes import BUILTIN_MOVING_SHAPES, moving_shapes_items
from miles.data.ocr import BUILTIN_OCR, ocr_prompts
from miles.data.shapes import shapes_items, shapes_prompts
from miles.data.shapes_edit import BUILTIN_SHAPES_EDIT, shapes_edit_items
from miles.data.source_images import read_pairs_folder, source_image_paths
from miles.utils.jsonl import read_jsonl_objects
from miles.utils.seeding import stream_rng

logger = logging.getLogger(__name__)

BUILTIN_SHAPES = "builtin:shapes"


class PromptDataError(ValueError):
    """A prompt file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class PromptFlags(FlagRecord):
    """The flags the prompt data reads (`miles.arguments.parser`: the rollout group, the hook paths), and the family's
    source images per prompt the start-up checks set (`source_image_range`, (0, 0) until then: text only)."""

    prompt_data: str
    input_key: str
    metadata_key: str
    image_key: str | None
    builtin_dataset_size: int
    rollout_seed: int
    rollout_batch_size: int
    allow_repeated_prompts: bool
    data_source_path: str | None
    source_image_range: tuple[int, int]


def prompt_flags(args: argparse.Namespace | PromptFlags) -> PromptFlags:
    """The record of `args`: itself when it is one (`load_records` builds it once), else built from the namespace."""
    return args if isinstance(args, PromptFlags) else PromptFlags.from_args(args)


def read_jsonl_records(
    path: str,
    *,
    input_key: str,
    metadata_key: str,
    image_key: str | None = None,
    source_images: bool = False,
    optional_sources: bool = False,
    flag: str = "--prompt-data",
) -> list[dict[str, Any]]:
    """Records {"prompt", "metadata", ["image"], ["source_images"]} of the file `flag` names: `image` the sft_loss
    target (`image_key`), `source_images` the paths of an editing / image-to-video prompt's inputs (`image` or
    `images`, checked to decode; with `optional_sources`, a family that also generates from text alone, a row may name
    none); paths resolve relative to the JSONL file."""
    base = os.path.dirname(os.path.abspath(path))
    records = []
    for line_no, row in read_jsonl_objects(path, PromptDataError, where=f"{flag} {path}"):
        prompt = row.get(input_key)
        if not isinstance(prompt, str):
            found = f"it is {type(prompt).__name__}" if input_key in row else f"fields: {', '.join(map(repr, row))}"
            raise PromptDataError(f"{path}:{line_no}: missing string field {input_key!r} (--input-key); {found}")
        metadata = row.get(metadata_key) or {}
        if not isinstance(metadata, dict):
            raise PromptDataError(f"{path}:{line_no}: field {metadata_key!r} (--metadata-key) must be an object")
        record: dict[str, Any] = {"prompt": prompt, "metadata": metadata}
        if image_key is not None:
            image = row.get(image_key)
            if not isinstance(image, str):
                raise PromptDataError(f"{path}:{line_no}: missing image path field {image_key!r} (--image-key)")
            image_path = image if os.path.isabs(image) else os.path.join(base, image)
            if not os.path.isfile(image_path):
                raise PromptDataError(f"{path}:{line_no}: image {image_path} not found")
            record["image"] = image_path
        if source_images and not (optional_sources and all(row.get(k) is None for k in ("image", "images"))):
            try:
                record["source_images"] = source_image_paths(row, base, f"{path}:{line_no}")
            except ValueError as exc:
                raise PromptDataError(str(exc)) from None
        records.append(record)
    return records


def read_text_prompts(path: str, flag: str = "--prompt-data") -> list[dict[str, Any]]:
    """Records {"prompt", "metadata": {}} from a .txt file, one prompt per non-blank line (flow_grpo's prompt files)."""
    if not os.path.isfile(path):
        raise PromptDataError(f"{flag} {path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as exc:
        raise PromptDataError(f"{flag} {path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    records = [{"prompt": line.strip(), "metadata": {}} for line in lines if line.strip()]
    if not records:
        raise PromptDataError(f"{flag} {path}: no prompts (the file is empty or blank)")
    return records


def read_prompt_file(
    path: str,
    args: argparse.Namespace | PromptFlags,
    *,
    image_key: str | None = None,
    flag: str = "--prompt-data",
    source_images: bool = False,
) -> list[dict[str, Any]]:
    """A prompt file by its extension: .txt one prompt per line, anything else JSONL (`read_jsonl_records`), or an
    editing family's folder of pairs (`read_pairs_folder`); `source_images`: the run's family edits or animates
    images, so every record names its source images (unless the family also generates from text alone: its
    source_image_range starts at 0)."""
    flags = prompt_flags(args)
    optional_sources = source_images and source_image_range(flags)[0] == 0
    if os.path.isdir(path):
        if not source_images:
            raise PromptDataError(
                f"{flag} {path} is a folder: a folder of (instruction, source image) pairs is for an editing or "
                "image-to-video family; this model generates from text (give a JSONL or .txt prompt file)"
            )
        try:
            return read_pairs_folder(path, targets=image_key is not None, flag=flag)
        except ValueError as exc:
            raise PromptDataError(str(exc)) from None
    if path.endswith(".txt") and image_key is None:
        if source_images and not optional_sources:
            raise PromptDataError(
                f"{flag} {path}: a .txt prompt file has no source images; this model edits or animates images, so "
                "give a JSONL file whose records name them ('image' or 'images')"
            )
        return read_text_prompts(path, flag)
    return read_jsonl_records(
        path,
        input_key=flags.input_key,
        metadata_key=flags.metadata_key,
        image_key=image_key,
        source_images=source_images,
        optional_sources=optional_sources,
        flag=flag,
    )


def wants_source_images(args: argparse.Namespace | PromptFlags) -> bool:
    """Whether the run's family conditions on source images (set at start-up: `args.source_image_range`)."""
    return source_image_range(args)[1] > 0


def source_image_range(args: argparse.Namespace | PromptFlags) -> tuple[int, int]:
    """The family's (fewest, most) source images per prompt; (0, 0) before the start-up checks set it."""
    low, high = prompt_flags(args).source_image_range
    return low, high


def check_source_image_counts(
    records: list[dict[str, Any]], args: argparse.Namespace | PromptFlags, flag: str, data: str
) -> None:
    """Every record carries as many source images as the family takes (`args.source_image_range`), and builtin
    worlds match the family: text-only worlds need a family that takes 0 source images, builtin:shapes-edit an
    editing one."""
    low, high = source_image_range(args)
    if high == 0:
        if data == BUILTIN_SHAPES_EDIT:
            raise PromptDataError(
                f"{flag} {BUILTIN_SHAPES_EDIT} holds editing triples (a source image and an instruction), and this "
                "model generates from text only: use an editing family (builtin:tiny-flux-kontext, ...)"
            )
        return
    if data.startswith("builtin:") and data != BUILTIN_SHAPES_EDIT and low > 0:
        raise PromptDataError(
            f"{flag} {data} holds text prompts, and this model edits or animates source images: use "
            f"{BUILTIN_SHAPES_EDIT} or a JSONL whose records name their source images ('image' or 'images')"
        )
    for line, record in enumerate(records, start=1):
        count = len(record.get("source_images") or [])
        if not low <= count <= high:
            want = str(low) if low == high else f"{low} to {high}"
            raise PromptDataError(f"{flag} {data}:{line}: {count} source image(s); this model takes {want} per prompt")


def sft_image_key(args: argparse.Namespace | PromptFlags, source_images: bool) -> str:
    """The JSONL key of sft_loss's target image: --image-key, else `image`, or `target` when `image` names the
    source image (an editing family's (source, instruction, target) triples)."""
    return prompt_flags(args).image_key or ("target" if source_images else "image")


def check_distinct_prompts(records: list[dict[str, Any]], args: argparse.Namespace | PromptFlags, source: str) -> None:
    """A rollout's prompt groups must be distinct prompts unless `--allow-repeated-prompts`: otherwise a short file
    would silently train on the same prompt several times in every rollout."""
    flags = prompt_flags(args)
    if flags.allow_repeated_prompts or flags.data_source_path:  # the user's own stream
        return

    # the same caption with another image (SFT's target, an edit's source) is another item; in-memory images are
    # always distinct
    def image_identity(i: int, image: Any) -> Any:
        if image is None:
            return None
        if isinstance(image, str) or (isinstance(image, list) and all(isinstance(p, str) for p in image)):
            return str(image)
        return i

    keys = {
        (r["prompt"], image_identity(i, r.get("image")), image_identity(i, r.get("source_images")))
        for i, r in enumerate(records)
    }
    if len(keys) < flags.rollout_batch_size:
        raise PromptDataError(
            f"--prompt-data {source}: {len(keys)} distinct prompt(s), fewer than --rollout-batch-size "
            f"{flags.rollout_batch_size}: every rollout would repeat prompts; add prompts, lower --rollout-batch-size, "
            "or pass --allow-repeated-prompts"
        )


def records_digest(records: list[dict[str, Any]]) -> str:
    """A short fingerprint of the prompts in order: resuming over a changed prompt file is reported."""
    h = hashlib.sha256()
    for record in records:
        h.update(str(record["prompt"]).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def load_records(args: argparse.Namespace, *, with_images: bool, resolution: int | None) -> list[dict[str, Any]]:
    """The run's prompt records: built-in worlds or --prompt-data's file; `with_images` sft_loss's (prompt, target)
    pairs; an editing / image-to-video family's records also name their source images (`source_images`)."""
    flags = PromptFlags.from_args(args)
    source_images = wants_source_images(flags)
    data, size, seed = flags.prompt_data, flags.builtin_dataset_size, flags.rollout_seed
    if data == BUILTIN_SHAPES_EDIT:
        records = shapes_edit_items(size, seed=seed, split="train", resolution=resolution, targets=with_images)
    elif data == BUILTIN_MOVING_SHAPES:  # sft_loss's targets are clips (F, H, W, 3)
        records = moving_shapes_items(size, seed=seed, split="train", resolution=resolution, clips=with_images)
    elif data == BUILTIN_OCR and not with_images:
        records = ocr_prompts(split="train")
    elif data == BUILTIN_SHAPES:
        if with_images:
            assert resolution is not None, "built-in shapes images need a resolution"
            records = shapes_items(size, seed=seed, split="train", resolution=resolution)
        else:
            records = shapes_prompts(size, seed=seed, split="train")
    else:
        image_key = sft_image_key(flags, source_images) if with_images else None
        records = read_prompt_file(data, flags, image_key=image_key, source_images=source_images)
    check_source_image_counts(records, flags, "--prompt-data", data)
    check_distinct_prompts(records, flags, data)
    return records


class PromptDataSource:
    """Serves `batch_size` record indices per rollout, reshuffled every epoch by (seed, epoch).

    The indices of rollout r depend only on r, so resuming at rollout r continues the same stream. Checkpoints
    still record `state_dict` (position, epoch, and what the stream is a function of: seed, batch size, record
    count and a digest of the records) so that a resume over different data or settings is reported.
    """

    def __init__(self, num_records: int, batch_size: int, *, seed: int, shuffle: bool = True, digest: str = "") -> None:
        if num_records < 1:
            raise PromptDataError("the prompt data has no records")
        self.num_records, self.batch_size, self.seed, self.shuffle = num_records, batch_size, seed, shuffle
        self.digest = digest

    def state_dict(self, next_rollout_id: int) -> dict[str, Any]:
        """What a checkpoint saved after rollout `next_rollout_id - 1` records about the stream."""
        return {
            "next_rollout_id": next_rollout_id,
            "epoch": self.epoch_of(next_rollout_id),
            "num_records": self.num_records,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "digest": self.digest,
        }

    def resume_mismatches(self, state: dict[str, Any], next_rollout_id: int) -> list[str]:
        """How resuming at `next_rollout_id` with this source differs from the saved `state` (empty: it continues
        the saved stream exactly)."""
        mine = self.state_dict(next_rollout_id)
        return [
            f"{key}: saved {state.get(key)!r}, now {value!r}" for key, value in mine.items() if state.get(key) != value
        ]

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_records)
        return stream_rng(self.seed, epoch).permutation(self.num_records)

    def indices(self, rollout_id: int) -> list[int]:
        out = []
        for position in range(rollout_id * self.batch_size, (rollout_id + 1) * self.batch_size):
            epoch, offset = divmod(position, self.num_records)
            out.append(int(self._epoch_order(epoch)[offset]))
        return out

    def epoch_of(self, rollout_id: int) -> int:
        return (rollout_id * self.batch_size) // self.num_records
