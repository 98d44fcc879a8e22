"""The engines' flags: --rollout-timeout's two forms and their allowances, --rollout-micro-batch-size, the ranges of
the start-up and sync deadlines, and what the parser hands the engine group."""

from __future__ import annotations

import argparse

import pytest

from miles.arguments.engine import (
    STEP_FLOOR_S,
    RolloutTimeout,
    engine_timeouts,
    parse_micro_batch_size,
    parse_rollout_timeout,
)
from miles.arguments.parser import parse_args


def test_a_number_is_per_step_per_sample_with_a_floor_and_total_is_per_call():
    per_step = parse_rollout_timeout("60")
    assert per_step == RolloutTimeout(per_step_per_sample_s=60.0)
    assert per_step.step_limit(4) == STEP_FLOOR_S and per_step.step_limit(16) == 960.0
    assert parse_rollout_timeout("total:3600") == RolloutTimeout(total_s=3600.0)
    assert "total:3600" in parse_rollout_timeout("total:3600").describe()
    for bad in ("0", "-5", "sum:10", "total:", "inf", "nan", "ten"):
        with pytest.raises(argparse.ArgumentTypeError, match="--rollout-timeout"):
            parse_rollout_timeout(bad)


def test_micro_batch_size_is_auto_or_a_whole_number():
    assert parse_micro_batch_size("auto") == "auto" and parse_micro_batch_size("4") == 4
    for bad in ("0", "-1", "2.5", "all"):
        with pytest.raises(argparse.ArgumentTypeError, match="--rollout-micro-batch-size"):
            parse_micro_batch_size(bad)


def test_the_parser_hands_the_engine_group_its_deadlines(capsys):
    defaults = parse_args([])
    assert defaults.rollout_micro_batch_size == "auto"
    assert engine_timeouts(defaults).rollout == RolloutTimeout()
    args = parse_args(
        ["--rollout-timeout", "total:900", "--rollout-sync-timeout", "30", "--rollout-micro-batch-size", "2"]
    )
    timeouts = engine_timeouts(args)
    assert (timeouts.rollout.total_s, timeouts.sync_s, args.rollout_micro_batch_size) == (900.0, 30.0, 2)
    with pytest.raises(SystemExit):
        parse_args(["--rollout-startup-timeout", "0"])
    assert "--rollout-startup-timeout must be > 0" in capsys.readouterr().err
