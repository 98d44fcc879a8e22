"""Input files checked before any actor starts: pipeline folders' model_index.json and JSONL prompt files, with
errors that name FILE:LINE."""

from __future__ import annotations

import argparse
import json
import os

from miles.algorithms import algorithm_of
from miles.data.moving_shapes import BUILTIN_MOVING_SHAPES
from miles.data.ocr import BUILTIN_OCR, unquoted_prompts
from miles.data.shapes_edit import BUILTIN_SHAPES_EDIT
from miles.rollout.data_source import (
    BUILTIN_SHAPES,
    check_source_image_counts,
    load_records,
    read_prompt_file,
    wants_source_images,
)
from miles.utils.eval_arguments import eval_enabled
from miles.utils.reward_spec import reward_spec_from_args, runs_rewards


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
    folders = {"--hf-checkpoint": args.hf_checkpoint, "--teacher-load": getattr(args, "teacher_load", None)}
    for role in algorithm.roles:  # each role's initial weights and every frozen network loaded from a checkpoint
        folders[role.flag("checkpoint")] = getattr(args, role.dest("checkpoint"), None)
        for network in role.frozen_networks:
            if network.path_flag is not None:
                folders["--" + network.path_flag.replace("_", "-")] = getattr(args, network.path_flag, None)
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
        records = load_records(args, with_images=with_images, resolution=None)  # source images decoded: checked
    check_ocr_prompts(args, records)
    eval_data = getattr(args, "eval_prompt_data", BUILTIN_SHAPES)
    if eval_enabled(args) and not getattr(args, "eval_function_path", None):
        eval_records = []
        if not eval_data.startswith("builtin:"):
            sources = wants_source_images(args)
            eval_records = read_prompt_file(eval_data, args, flag="--eval-prompt-data", source_images=sources)
        check_source_image_counts(eval_records, args, "--eval-prompt-data", eval_data)


def check_ocr_prompts(args: argparse.Namespace, records: list[dict] | None) -> None:
    """With the ocr reward every training prompt needs its target text in double quotes (flow_grpo's format); the
    shapes worlds (`records` None) have none."""
    if not runs_rewards(args, algorithm_of(args).scores_rewards) or getattr(args, "data_source_path", None):
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
