"""The `auto` sizes (miles/plan/auto.py): concrete CPU defaults at parse, and on CUDA the largest the plan says fits,
searched on a stand-in for the simulation whose memory grows with the sizes (the real re-plans are what `replan`
runs: tests/fast/plan/test_plan.py plans the tiny model for real)."""

from __future__ import annotations

import argparse
import types

import pytest
import torch

from miles.arguments.parser import parse_args
from miles.plan import auto as auto_module
from miles.plan import startup as startup_module
from miles.plan.auto import auto_start, climb, largest, micro_batch_candidates, resolve_auto_sizes
from miles.plan.suggest import with_changes


def stand_in_report(args: argparse.Namespace, usable: int) -> dict:
    """A trainer GPU holding 20 + 10 per pair of a micro-batch (20 + 2 per pair checkpointed), and an engine-only
    GPU holding 10 + 15 per sample of its forward (its positions rule says 16)."""
    per_pair = 2 if args.gradient_checkpointing else 10
    engine_rows = 16 if args.rollout_micro_batch_size == "auto" else args.rollout_micro_batch_size
    gpus = [
        {"index": 0, "roles": ["actor rank 0"], "peak_bytes": 20 + per_pair * args.micro_batch_size},
        {"index": 1, "roles": ["engine 0"], "peak_bytes": 10 + 15 * engine_rows},
    ]
    worst = max(gpus, key=lambda g: g["peak_bytes"])
    return {"gpus": gpus, "usable_bytes": usable, "fits": worst["peak_bytes"] <= usable, "worst_gpu": worst}


@pytest.fixture
def search(monkeypatch):
    """The plan's auto step on the stand-in with `usable` bytes, from a CUDA run's flags, as make_plan runs it (the
    first plan at `auto_start`); returns (the chosen values, the plan under them, the re-plans run)."""
    planned, limit = [], [100]

    def replan(args, changes, settings, build_report, base):
        changed = with_changes(args, changes)
        planned.append(changed)
        return stand_in_report(changed, limit[0]), base

    monkeypatch.setattr(auto_module, "replan", replan)
    base = types.SimpleNamespace(window={"pair": torch.zeros(64)}, engine_micro_batch=16)

    def run(*flags: str, usable: int = 100):
        limit[0] = usable
        args = parse_args(["--device", "cuda", "--plan", *flags])
        start = auto_start(args)
        first = stand_in_report(with_changes(args, start), usable)
        changes, report, _ = resolve_auto_sizes(args, first, None, None, base, start)
        return {k: v for c in changes for k, v in c.values.items()}, report, len(planned)

    return run


def test_cpu_defaults_are_concrete_at_parse_and_say_what_was_auto():
    args = parse_args(["--loss-type", "dmd2"])
    assert (args.micro_batch_size, args.gradient_checkpointing) == (32, False)
    assert args.auto_sizes == ("micro_batch_size", "gradient_checkpointing", "rollout_micro_batch_size")
    assert args.critic_micro_batch_size == 32 and "critic_micro_batch_size" in args.role_followers
    given = parse_args(["--gradient-checkpointing", "--micro-batch-size", "4", "--rollout-micro-batch-size", "2"])
    assert (given.micro_batch_size, given.gradient_checkpointing, given.auto_sizes) == (4, True, ())
    assert parse_args(["--gradient-checkpointing", "off"]).gradient_checkpointing is False


def test_largest_bisects_to_the_largest_candidate_that_fits():
    for limit in range(0, 40):
        tried = []

        def plan(size, limit=limit, tried=tried):
            tried.append(size)
            return size if size <= limit else None

        candidates = micro_batch_candidates(32)
        expected = max((c for c in candidates if c <= limit), default=None)
        assert largest(candidates, plan) == expected
        assert len(tried) <= 3
    assert micro_batch_candidates(6) == [6, 4, 2, 1]


@pytest.mark.parametrize("fixed", [0, 5, 40])
@pytest.mark.parametrize("per_size", [1, 3, 10])
def test_climb_finds_the_largest_that_fits_on_any_convex_memory(fixed, per_size):
    """Memory a convex function of the size (a constant plus a multiple, and a steeper part past a knee, as a
    peak moving to a later phase does): the climb finds what measuring every size finds, in fewer measurements."""
    sizes = micro_batch_candidates(32)[::-1]
    for knee in (1, 4, 16):
        for usable in range(0, 200, 3):

            def memory(size, knee=knee):
                return fixed + per_size * size + 2 * per_size * max(0, size - knee)

            measured = []

            def measure(size, memory=memory, measured=measured):
                measured.append(size)
                return memory(size), size

            expected = max((s for s in sizes if memory(s) <= usable), default=None)
            assert climb(sizes, measure, usable) == expected
            assert measured[0] == 1 and len(measured) == len(set(measured))
            at_most = 1 if expected is None else sizes.index(expected) + 2  # here: at most one size over it
            assert len(measured) <= at_most


def test_climb_plans_one_size_past_the_smallest_when_the_next_does_not_fit():
    measured = []

    def measure(size):
        measured.append(size)
        return 60 + 40 * size, size

    assert climb([1, 2, 4, 8, 16, 32], measure, usable=120) == 1 and measured == [1, 2]
    measured.clear()  # 1 and 2 fit; the line through them leaves 4 (50), which is planned and fits; 8 is ruled out
    assert climb([1, 2, 4, 8, 16, 32], lambda s: (measured.append(s), (10 + 10 * s, s))[1], usable=55) == 4
    assert measured == [1, 2, 4]
    measured.clear()  # the same line rules out 4 at 45: 2 without planning it
    assert climb([1, 2, 4, 8, 16, 32], lambda s: (measured.append(s), (10 + 10 * s, s))[1], usable=45) == 2
    assert measured == [1, 2]


def test_the_trainer_gets_the_largest_micro_batch_without_checkpointing(search):
    values, report, replans = search()  # 20 + 10 x 32 does not fit 100; 20 + 10 x 8 does, 16 does not
    assert values == {"micro_batch_size": 8, "rollout_micro_batch_size": 4}  # engine: 10 + 15 x 4 <= 100 < 10 + 15 x 8
    assert report["fits"] and replans <= 4 + 2  # the first plan is micro-batch 1: 2, 8, 16; the engine's two


def test_checkpointing_only_when_no_micro_batch_fits_without_it(search):
    values, report, replans = search("--rollout-micro-batch-size", "1", usable=25)  # 20 + 10 x 1 > 25
    assert values == {"gradient_checkpointing": True, "micro_batch_size": 2}  # 20 + 2 x 2 <= 25 < 20 + 2 x 4
    assert (
        report["fits"] and replans == 2
    )  # micro-batch 1 unchecked (the first plan) says no; checked: 1, 2 (4 ruled out)


def test_given_sizes_are_kept(search):
    values, report, replans = search("--micro-batch-size", "16", "--gradient-checkpointing", "off")
    assert values == {"rollout_micro_batch_size": 4} and not report["fits"] and replans <= 3


def test_the_startup_check_hands_the_chosen_sizes_to_the_run(monkeypatch):
    """check_plan applies the plan's `auto` values to the run's flags; a role's override that follows the shared
    micro-batch follows it, one the user gave stays."""
    report = {
        "fits": True,
        "worst_gpu": {"index": 0, "peak_bytes": 1, "phase": "train", "roles": ["actor rank 0"]},
        "usable_bytes": 2,
        "plan_seconds": 1.0,
        "auto": {"flags": "--micro-batch-size 8", "values": {"micro_batch_size": 8}},
    }
    monkeypatch.setattr(startup_module, "make_plan", lambda args: report)
    args = parse_args(["--loss-type", "dmd2", "--critic-lr", "1e-5"])
    args.device = "cuda"
    startup_module.check_plan(args)
    assert (args.micro_batch_size, args.critic_micro_batch_size, args.critic_lr) == (8, 8, 1e-5)


def test_a_config_file_says_on_off_and_auto(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("gradient-checkpointing: true\nmicro-batch-size: auto\n")
    args = parse_args(["--config", str(config)])
    assert (args.gradient_checkpointing, args.micro_batch_size, args.auto_sizes[0]) == (True, 32, "micro_batch_size")
    config.write_text("gradient-checkpointing: false\n")
    assert parse_args(["--config", str(config)]).gradient_checkpointing is False
