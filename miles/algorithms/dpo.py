"""dpo: Diffusion-DPO in flow form, offline from a preference file (--train-only --dpo-preference-data FILE) or online
from the rollout's prompt groups (best vs worst sample), against a reference kept as a shadow of the trained weights:
the initial model, refreshed from the learner every --dpo-ref-update-interval optimizer steps."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from miles.algorithms.base import COMMON_PANELS, EVAL_PANELS, Algorithm, FrozenNetwork, Role
from miles.utils.jsonl import read_jsonl_objects
from miles.utils.ranges import AT_LEAST_0, POSITIVE

REFERENCE = FrozenNetwork("dpo_ref", "shadow")  # θ_ref: a copy of θ at start, moved only by the refresh
ONLINE_REF_UPDATE_INTERVAL = 40  # flow_grpo's config.train.ref_update_step (optimizer steps)
PREFERENCE_KEYS = ("prompt", "image_0", "image_1", "preferred")  # one JSON object per line (docs/.../data-formats)


class PreferenceDataError(ValueError):
    """A preference file that cannot be used; the message names the file, the line and the flag."""


@dataclass(frozen=True)
class PreferenceRecord:
    """One preference pair: the prompt and the chosen / rejected image paths (absolute)."""

    prompt: str
    chosen: str
    rejected: str


def read_preference_file(path: str, *, check_images: bool = True) -> list[PreferenceRecord]:
    """Every record of a JSONL preference file: {"prompt": str, "image_0": path, "image_1": path, "preferred": 0|1},
    image paths relative to the file (or absolute). Blank lines are skipped. With `check_images` each image must exist
    and be readable as an image (PIL opens and verifies it; pixels are decoded later, when it is encoded)."""
    where = f"--dpo-preference-data {path}"
    base = os.path.dirname(os.path.abspath(path))
    records: list[PreferenceRecord] = []
    for line_no, row in read_jsonl_objects(path, PreferenceDataError, where=where):
        missing = [key for key in PREFERENCE_KEYS if key not in row]
        if missing:
            raise PreferenceDataError(
                f"{path}:{line_no}: missing key(s) {', '.join(repr(k) for k in missing)} (a record is "
                f'{{"prompt", "image_0", "image_1", "preferred"}}; {where})'
            )
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise PreferenceDataError(f"{path}:{line_no}: 'prompt' must be a non-empty string ({where})")
        preferred = row["preferred"]
        if isinstance(preferred, bool) or preferred not in (0, 1):
            raise PreferenceDataError(
                f"{path}:{line_no}: 'preferred' must be 0 or 1 (which of image_0 / image_1 is preferred), got "
                f"{json.dumps(preferred)} ({where})"
            )
        images = [_image_path(row, key, base, path, line_no, where, check_images) for key in ("image_0", "image_1")]
        records.append(PreferenceRecord(row["prompt"], images[preferred], images[1 - preferred]))
    return records


def _image_path(row: dict[str, Any], key: str, base: str, path: str, line_no: int, where: str, check: bool) -> str:
    value = row[key]
    if not isinstance(value, str) or not value:
        raise PreferenceDataError(f"{path}:{line_no}: {key!r} must be an image path string ({where})")
    image_path = value if os.path.isabs(value) else os.path.join(base, value)
    if not check:
        return image_path
    if not os.path.isfile(image_path):
        raise PreferenceDataError(f"{path}:{line_no}: {key} {image_path} not found ({where})")
    from PIL import Image, UnidentifiedImageError  # here: parsing a run without a preference file needs no PIL

    try:
        with Image.open(image_path) as image:
            image.verify()
    except (OSError, UnidentifiedImageError, SyntaxError) as exc:  # PIL raises SyntaxError for some broken files
        raise PreferenceDataError(
            f"{path}:{line_no}: {key} {image_path} is not a readable image ({exc}; {where})"
        ) from None
    return image_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dpo (Diffusion-DPO in flow form)")
    group.add_argument(
        "--dpo-beta",
        type=float,
        default=100.0,
        help="β of z = −(β/2)·[(e_θʷ − e_refʷ) − (e_θˡ − e_refˡ)]; not comparable across parameterisations.",
    )
    group.add_argument(
        "--dpo-preference-data",
        default=None,
        help="Offline DPO (with --train-only): JSONL of {prompt, image_0, image_1, preferred}.",
    )
    group.add_argument(
        "--dpo-ref-update-interval",
        type=int,
        default=None,
        help="Refresh θ_ref ← θ every K optimizer steps (0: never; default 40 online, 0 offline).",
    )
    group.add_argument(
        "--dpo-keep-zero-spread",
        action="store_true",
        help="Online: train groups whose rewards are all equal (first vs last sample) instead of dropping them.",
    )


def offline(args: argparse.Namespace) -> bool:
    return bool(args.dpo_preference_data)


def validate(args: argparse.Namespace) -> list[str]:
    errors = []
    if offline(args) and not args.train_only:
        errors.append("--dpo-preference-data trains offline on preference pairs: pass --train-only")
    if args.train_only and not offline(args):
        errors.append("--loss-type dpo --train-only trains on preference pairs: pass --dpo-preference-data FILE")
    if offline(args) and args.dpo_keep_zero_spread:
        errors.append("--dpo-keep-zero-spread applies to online pairs (rollout groups), not to --dpo-preference-data")
    if offline(args) and args.eval_interval is not None:
        errors.append("offline DPO starts no engine to evaluate with: drop --eval-interval (or pass 0)")
    if offline(args) and os.path.isfile(args.dpo_preference_data):
        try:  # before any actor starts: a bad line fails here, naming the file and line
            records = read_preference_file(args.dpo_preference_data)
        except PreferenceDataError as exc:
            errors.append(str(exc))
        else:
            if len(records) < args.rollout_batch_size:
                errors.append(
                    f"--dpo-preference-data {args.dpo_preference_data}: {len(records)} pair(s), fewer than "
                    f"--rollout-batch-size {args.rollout_batch_size}"
                )
    elif offline(args):
        errors.append(f"--dpo-preference-data {args.dpo_preference_data}: file not found")
    if not offline(args) and args.n_samples_per_prompt < 2:
        errors.append("online DPO pairs the best and the worst sample of a prompt group: --n-samples-per-prompt ≥ 2")
    return errors


def derive(args: argparse.Namespace) -> dict[str, Any]:
    derived: dict[str, Any] = {}
    if args.dpo_ref_update_interval is None:
        derived["dpo_ref_update_interval"] = 0 if offline(args) else ONLINE_REF_UPDATE_INTERVAL
    if offline(args):
        derived["n_samples_per_prompt"] = 1  # one preference record is one pair: there are no sample groups
        if args.eval_interval is None:
            derived["eval_interval"] = 0  # the shapes eval samples with the engines, which offline runs do not start
    return derived


ALGORITHM = Algorithm(
    name="dpo",
    async_rollout=True,
    roles=(Role("actor", frozen_networks=(REFERENCE,)),),
    samples_sde=False,  # online pairs are ODE samples; the loss needs only their clean latents
    accepts_train_only=True,  # offline: --train-only --dpo-preference-data (RolloutSpec.dataset)
    guidance_scale=1.0,  # the loss trains the conditional (CFG-free) velocity, so rollouts sample CFG-free too
    shapes_eval_interval=20,
    add_arguments=add_arguments,
    flag_ranges={"dpo_beta": POSITIVE, "dpo_ref_update_interval": AT_LEAST_0},
    exclusive_flags=("dpo_preference_data", "dpo_ref_update_interval", "dpo_keep_zero_spread"),
    validate=validate,
    derive=derive,
    progress_keys=(
        ("reward", "rollout/reward_mean", ".3f"),
        ("loss", "train/loss", ".4f"),
        ("acc", "train/dpo_implicit_acc", ".2f"),
        ("grad", "train/grad_norm", ".3f"),
    ),
    plot_panels=(
        ("rollout reward", ("rollout/reward_mean",)),
        *EVAL_PANELS,
        ("DPO loss (log 2 at θ = θ_ref)", ("train/loss",)),
        ("implicit accuracy / kept pairs", ("train/dpo_implicit_acc", "train/dpo_pair_weight")),
        ("flow errors", ("train/dpo_err_w", "train/dpo_err_l", "train/dpo_ref_err_w", "train/dpo_ref_err_l")),
        *COMMON_PANELS,
    ),
    identifying_metrics=("train/dpo_implicit_acc",),
)
