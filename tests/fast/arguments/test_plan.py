"""The planner's flags (miles/arguments/plan.py): `auto` or a whole number, on / off / auto, and the `auto` sizes
made concrete at parse with the CPU defaults, naming which were auto."""

from __future__ import annotations

import argparse

import pytest

from miles.arguments.parser import default_args
from miles.arguments.plan import CPU_MICRO_BATCH_SIZE, auto_size_defaults, parse_auto_size, parse_on_off_auto


def test_a_size_is_auto_or_a_whole_number():
    assert parse_auto_size("auto") == "auto" and parse_auto_size("16") == 16
    with pytest.raises(argparse.ArgumentTypeError, match=r"'1.5': give auto or a whole number >= 1"):
        parse_auto_size("1.5")


@pytest.mark.parametrize(("text", "value"), [("on", True), ("TRUE", True), ("1", True), ("Off", False), ("no", False)])
def test_on_off_reads_the_usual_spellings(text, value):
    assert parse_on_off_auto(text) is value


def test_on_off_keeps_auto_and_refuses_anything_else():
    assert parse_on_off_auto("AUTO") == "auto"
    with pytest.raises(argparse.ArgumentTypeError, match=r"'maybe': give on, off or auto"):
        parse_on_off_auto("maybe")


def test_auto_sizes_get_the_cpu_defaults_and_are_named():
    args = default_args(micro_batch_size="auto", gradient_checkpointing="auto", rollout_micro_batch_size="auto")
    assert auto_size_defaults(args) == {
        "auto_sizes": ("micro_batch_size", "gradient_checkpointing", "rollout_micro_batch_size"),
        "micro_batch_size": CPU_MICRO_BATCH_SIZE,
        "gradient_checkpointing": False,
    }  # the engines' micro-batch stays auto: their own rule sizes it
    given = default_args(micro_batch_size=4, gradient_checkpointing=True, rollout_micro_batch_size=2)
    assert auto_size_defaults(given) == {"auto_sizes": ()}


def test_plan_gpu_is_read_at_parse_time_and_kept_as_given(capsys):
    from miles.arguments.parser import parse_args
    from tests.fast.arguments.test_parser import BASE, parse_error

    assert parse_args([*BASE, "--plan-gpu", "H200-141GB"]).plan_gpu == "H200-141GB"
    assert parse_args([*BASE, "--plan-gpu", "24.5"]).plan_gpu == "24.5"
    for bad in ("nosuchgpu", "0", "-80"):
        err = parse_error([*BASE, "--plan-gpu", bad], capsys)
        assert f"argument --plan-gpu: '{bad}': use one of h100-80gb, h200-141gb" in err
