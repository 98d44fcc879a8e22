"""Every numeric flag has a declared range (shared flags in miles/utils/ranges.py, an algorithm's own in its
declaration, a role override the actor flag's), and a value outside it fails at parse time naming the flag, from the
command line and from --config alike."""

from __future__ import annotations

import math

import pytest

from miles.algorithms import BUILTIN_ALGORITHMS
from miles.utils.arg_rules import flag_ranges
from miles.utils.arguments import build_parser, parse_args
from miles.utils.plan_arguments import parse_auto_size
from miles.utils.ranges import FLAG_RANGES, Range

RANGES = flag_ranges(BUILTIN_ALGORITHMS)

BASE = ["--hf-checkpoint", "/tmp/x", "--prompt-data", "builtin:shapes"]
NUMBER_TYPES = {int: int, float: float, parse_auto_size: int}  # auto or a number: its numbers have a range too
NUMERIC = sorted(a.dest for a in build_parser(BUILTIN_ALGORITHMS)._actions if a.type in NUMBER_TYPES)
TYPES = {a.dest: NUMBER_TYPES.get(a.type, a.type) for a in build_parser(BUILTIN_ALGORITHMS)._actions}


def outside(bounds: Range, kind: type) -> list[str]:
    """Values just outside `bounds`, worked out here from the interval (plus nan for floats)."""
    step = 1 if kind is int else 1e-3
    values = []
    if bounds.low is not None:
        values.append(bounds.low if bounds.low_open else bounds.low - step)
    if bounds.high is not None:
        values.append(bounds.high if bounds.high_open else bounds.high + step)
    out = [str(kind(v)) if kind is int else repr(float(v)) for v in values]
    return out + (["nan", "inf"] if kind is float else [])


CASES = [(dest, value) for dest in NUMERIC for value in outside(RANGES.get(dest, Range()), TYPES[dest])]


def test_every_numeric_flag_declares_a_range():
    missing = [dest for dest in NUMERIC if dest not in RANGES]
    assert not missing, f"numeric flags without a range (ranges.py or the algorithm's flag_ranges): {missing}"
    assert not set(RANGES) - set(NUMERIC), "ranges of flags that do not exist"
    assert all(outside(RANGES[d], TYPES[d]) for d in NUMERIC)  # every flag has something to reject


def test_each_range_is_declared_once_beside_its_flag():
    declared = [dest for algorithm in BUILTIN_ALGORITHMS for dest in algorithm.flag_ranges]
    assert len(declared) == len(set(declared)) and not set(declared) & set(FLAG_RANGES)
    own = {a.dest for a in build_parser(())._actions}
    assert set(FLAG_RANGES) <= own, "ranges.py holds only the shared flags' ranges"
    assert (
        RANGES["critic_lr"] == FLAG_RANGES["lr"]
        and RANGES["critic_micro_batch_size"] == FLAG_RANGES["micro_batch_size"]
    )


def test_defaults_are_in_range():
    args = parse_args(BASE)
    for dest in NUMERIC:
        value = getattr(args, dest)
        assert value is None or RANGES[dest].contains(value), (dest, value)


@pytest.mark.parametrize(("dest", "value"), CASES, ids=[f"{d}={v}" for d, v in CASES])
def test_out_of_range_value_is_rejected_naming_the_flag(dest, value, capsys):
    name = "--" + dest.replace("_", "-")
    with pytest.raises(SystemExit):
        parse_args([*BASE, name, value])
    assert f"{name} must be {RANGES[dest].describe()}, got" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("bounds", "inside", "rejected"),
    [
        (Range(0, 1, low_open=True), [1e-9, 1.0], [0.0, 1.0000001, -1.0]),
        (Range(0, 1, high_open=True), [0.0, 0.999], [1.0, -1e-9]),
        (Range(1), [1, 10**9], [0, -3]),
        (Range(), [-1e30, 0.0], [math.nan, math.inf, -math.inf]),
    ],
)
def test_range_bounds(bounds, inside, rejected):
    assert all(bounds.contains(v) for v in inside)
    assert not any(bounds.contains(v) for v in rejected)


def test_noise_level_below_zero_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--diffusion-noise-level", "-1"])
    assert "--diffusion-noise-level must be ≥ 0, got -1.0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("yaml_line", "message"),
    [
        ("micro-batch-size: 2.5", "key 'micro-batch-size' (--micro-batch-size): '2.5': give auto or a whole number"),
        ("lr: -0.1", "key 'lr': --lr must be > 0, got -0.1"),
        ("adam_beta2: 1.0", "key 'adam_beta2': --adam-beta2 must be in [0, 1), got 1.0"),
        ("use-lora: 1", "key 'use-lora' (--use-lora) takes true or false, got 1"),
        ("sft-timestep-sampling: beta", "key 'sft-timestep-sampling' (--sft-timestep-sampling): 'beta' is not one of"),
        ("dp-size: [1, 2]", "key 'dp-size' (--dp-size) takes one value"),
    ],
)
def test_config_values_are_converted_and_checked_naming_file_and_key(tmp_path, capsys, yaml_line, message):
    config = tmp_path / "run.yaml"
    config.write_text(yaml_line + "\n")
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--config", str(config)])
    assert f"--config {config}: {message}" in capsys.readouterr().err


def test_config_values_get_the_flags_types(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lr: 1e-4\nmicro-batch-size: 4\nrollout-batch-size: '4'\n")  # YAML reads 1e-4 as a string
    args = parse_args([*BASE, "--config", str(config), "--n-samples-per-prompt", "2"])
    assert (args.lr, args.micro_batch_size, args.rollout_batch_size) == (1e-4, 4, 4)
    assert type(args.lr) is float and type(args.rollout_batch_size) is int
