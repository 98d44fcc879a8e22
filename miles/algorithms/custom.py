"""custom_loss: the user's own hooks, loaded from the --custom-*-path flags; its rollouts are Flow-GRPO's SDE
trajectories unless a conversion path replaces them (or dataset pairs with --train-only). It may read the frozen
teacher when --teacher-load is given."""

from __future__ import annotations

import argparse

from miles.algorithms.base import TEACHER, Algorithm, Role

REQUIRED = ("custom_prepare_train_batch_path", "custom_loss_function_path")
HOOK_FLAGS = (*REQUIRED, "custom_train_input_postprocess_path", "custom_train_output_path")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("custom_loss (the training hooks: pkg.mod.fn or path/file.py:fn)")
    group.add_argument("--custom-prepare-train-batch-path", default=None, help="custom_loss: the prepare hook.")
    group.add_argument("--custom-loss-function-path", default=None, help="custom_loss: the formula hook.")
    group.add_argument(
        "--custom-train-input-postprocess-path", default=None, help="custom_loss: post-process the train pairs."
    )
    group.add_argument("--custom-train-output-path", default=None, help="custom_loss: what `train` returns.")


def validate(args: argparse.Namespace) -> list[str]:
    missing = [f"--{dest.replace('_', '-')}" for dest in REQUIRED if not getattr(args, dest)]
    if not missing:
        return []
    return [
        f"--loss-type custom_loss runs your hooks: add {' and '.join(missing)} (pkg.mod.fn or file.py:fn; "
        "docs/user-guide/customization.md)"
    ]


ALGORITHM = Algorithm(
    name="custom_loss",
    roles=(Role("actor", frozen_networks=(TEACHER,)),),
    accepts_train_only=True,
    add_arguments=add_arguments,
    exclusive_flags=HOOK_FLAGS,  # under another loss type the loss hub picks the hooks: these would be ignored
    reads=("*", "ref_mode"),  # the user's hooks may read any algorithm's flags, and the reference
    validate=validate,
)
