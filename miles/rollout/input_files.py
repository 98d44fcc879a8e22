"""Input files checked before any actor starts: pipeline folders' model_index.json and JSONL prompt files, with
errors that name FILE:LINE."""

from __future__ import annotations

import argparse
import json
import logging
import os

from miles.algorithms import algorithm_of
from miles.arguments.evaluation import eval_enabled
from miles.arguments.reward_spec import reward_spec_from_args, runs_rewards
from miles.data.moving_shapes import BUILTIN_MOVING_SHAPES
from miles.data.ocr import BUILTIN_OCR, unquoted_prompts
from miles.data.shapes_edit import BUILTIN_SHAPES_EDIT
from miles.data.source_images import SOURCE_IMAGE_KEYS
from miles.models.builtin import builtin_family_name
from miles.models.registry import source_image_families
from miles.rollout.data_source import (
    BUILTIN_SHAPES,
    PromptDataError,
    check_source_image_counts,
    load_records,
    read_prompt_file,
    sft_image_key,
    wants_source_images,
)
from miles.utils.jsonl import read_jsonl_objects

logger = logging.getLogger(__name__)


class InputFileError(ValueError):
    """An input file that cannot be read; the message names the file, the line and the flag."""


def check_model_index(folder: str | None, flag: str) -> None:
    """`folder` must exist and hold a pipeline (model_index.json, a UTF-8 JSON object) or a transformer
    (transformer/config.json or config.json): found before any actor starts rather than by a rank loading it."""
    if not folder:
        return
    if not os.path.exists(folder):
        raise InputFileError(f"{flag} {folder}: no such file or folder (a local pipeline or transformer folder)")
    if not os.path.isdir(folder):
        raise InputFileError(f"{flag} {folder}: not a folder (a local pipeline or transformer folder)")
    path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(path):
        if not any(
            os.path.isfile(os.path.join(folder, *p)) for p in (("config.json",), ("transformer", "config.json"))
        ):
            raise InputFileError(
                f"{flag} {folder}: holds neither model_index.json (a pipeline) nor config.json / "
                "transformer/config.json (a transformer)"
            )
        return
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InputFileError(f"{path}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x}) ({flag} {folder})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}) ({flag} {folder})") from None
    if not isinstance(data, dict):
        raise InputFileError(f"{path}:1: expected a JSON object, got {type(data).__name__} ({flag} {folder})")


def check_input_files(args: argparse.Namespace) -> None:
    """Every file the run reads at start-up, before any actor starts (the driver checks while Ray starts)."""
    algorithm = algorithm_of(args)
    folders = {"--hf-checkpoint": args.hf_checkpoint, "--teacher-load": args.teacher_load}
    for role in algorithm.roles:  # each role's initial weights and every frozen network loaded from a checkpoint
        folders[role.flag("checkpoint")] = getattr(args, role.dest("checkpoint"))
        for network in role.frozen_networks:
            if network.path_flag is not None:
                folders["--" + network.path_flag.replace("_", "-")] = getattr(args, network.path_flag)
    for flag, folder in folders.items():
        check_model_index(folder, flag)
    with_images = not algorithm.uses_engines  # dataset pairs: prompts with images
    if args.prompt_data == BUILTIN_OCR and with_images:
        raise InputFileError(
            f"--prompt-data {BUILTIN_OCR} holds prompts only; --loss-type {algorithm.name} trains on prompts with images"
        )
    if args.prompt_data.startswith("builtin:"):  # a built-in world matches the family: text, or source images
        check_source_image_counts([], args, "--prompt-data", args.prompt_data)
    records = None  # a built-in world's, generated
    if args.prompt_data not in (BUILTIN_SHAPES, BUILTIN_SHAPES_EDIT, BUILTIN_MOVING_SHAPES):
        image_key = sft_image_key(args, wants_source_images(args)) if with_images else None
        check_record_fields(args, args.prompt_data, "--prompt-data", image_key)
        records = load_records(args, with_images=with_images, resolution=None)  # source images decoded: checked
    check_ocr_prompts(args, records)
    eval_data = args.eval_prompt_data
    if eval_enabled(args) and not args.eval_function_path:
        eval_records = []
        if not eval_data.startswith("builtin:"):
            check_record_fields(args, eval_data, "--eval-prompt-data", None)
            sources = wants_source_images(args)
            eval_records = read_prompt_file(eval_data, args, flag="--eval-prompt-data", source_images=sources)
        check_source_image_counts(eval_records, args, "--eval-prompt-data", eval_data)


def check_ocr_prompts(args: argparse.Namespace, records: list[dict] | None) -> None:
    """With the ocr reward every training prompt needs its target text in double quotes (flow_grpo's format); the
    shapes worlds (`records` None) have none."""
    if not runs_rewards(args, algorithm_of(args).scores_rewards) or args.data_source_path:
        return
    if "ocr" not in dict(reward_spec_from_args(args)):
        return
    if records is None:
        raise InputFileError(
            f"--rm-type ocr reads the target text between double quotes in each prompt, and the prompts of "
            f"--prompt-data {args.prompt_data} have none: use --prompt-data {BUILTIN_OCR} or a file of prompts such "
            'as a sign that says "OPEN"'
        )
    unquoted = unquoted_prompts(records)
    if unquoted:
        raise InputFileError(
            f"--prompt-data {args.prompt_data} record {unquoted[0]} ({len(unquoted)} of {len(records)} unquoted): "
            f"{records[unquoted[0] - 1]['prompt']!r} has no target text in double quotes, which --rm-type ocr "
            'reads (e.g. a sign that says "OPEN")'
        )


def check_record_fields(args: argparse.Namespace, path: str, flag: str, image_key: str | None) -> None:
    """A JSONL prompt file's fields that no part of the run reads: a source image for a family that generates from
    text only is an error naming the field, the family and the families that take one; any other field a warning
    naming it (a misspelt --input-key, a field the records never carry). .txt files and folders have no fields."""
    if os.path.isdir(path) or path.endswith(".txt") or not os.path.isfile(path):
        return  # a missing file is named by the reader
    read = {args.input_key, args.metadata_key, image_key} | (
        set(SOURCE_IMAGE_KEYS) if wants_source_images(args) else set()
    )
    unread: dict[str, int] = {}
    for line, row in read_jsonl_objects(path, PromptDataError, where=f"{flag} {path}"):
        for key in row.keys() - read:
            if key in SOURCE_IMAGE_KEYS:
                family = builtin_family_name(args.hf_checkpoint, args.model_family) or args.model_family
                raise InputFileError(
                    f"{path}:{line}: field {key!r} names a source image, and the {family} family generates from text "
                    f"only ({flag}): use a family that takes source images ({', '.join(source_image_families())}) or "
                    "drop the field"
                )
            unread.setdefault(key, line)
    if unread:
        fields = ", ".join(f"{key!r} (line {line})" for key, line in sorted(unread.items(), key=lambda kv: kv[1]))
        logger.warning(
            "%s %s: no part of this run reads the field(s) %s; it reads %s (--input-key, --metadata-key%s)",
            flag,
            path,
            fields,
            ", ".join(repr(k) for k in sorted(k for k in read if k)),
            ", --image-key" if image_key else "",
        )
