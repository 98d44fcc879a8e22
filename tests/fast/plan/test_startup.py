"""The start-up check of a CUDA run (miles/plan/startup.py)."""

from __future__ import annotations

import pytest

from miles.arguments.parser import parse_args
from miles.plan.startup import PlanDoesNotFit, check_plan
from tests.fast.plan.plan_cases import SMALL


def test_startup_refuses_a_cuda_run_that_would_not_fit(monkeypatch):
    """--plan-gpu as a stated size (0.01 GiB): the refusal names the GPU, the role, the phase and what fits."""
    monkeypatch.setattr("miles.plan.suggest.MAX_REPLANS", 1)
    sizes = ["--micro-batch-size", "4", "--gradient-checkpointing", "off", "--rollout-micro-batch-size", "2"]
    args = parse_args([*SMALL, *sizes, "--plan-gpu", "0.01"])  # given sizes: no `auto` search (test_auto.py)
    args.device = "cuda"  # what a CUDA machine resolves --device auto to; the plan itself runs on the CPU
    with pytest.raises(PlanDoesNotFit, match=r"GPU \d+ \((actor rank 0|engine 0)[^)]*\) needs .* in (train|generate)"):
        check_plan(args)
    args.no_plan_check = True
    assert check_plan(args) is None


def test_a_planner_error_at_start_up_says_it_is_the_planners_and_how_to_start_without_it(monkeypatch):
    def broken(args):
        raise RuntimeError("a simulated op the planner does not know")

    monkeypatch.setattr("miles.plan.startup.make_plan", broken)
    args = parse_args(["--loss-type", "policy_loss", *SMALL])  # the sizes left auto: the plan would size them
    args.device = "cuda"
    with pytest.raises(RuntimeError, match="does not know") as info:
        check_plan(args)
    assert info.value.__notes__ == [
        "the start-up plan failed while simulating this run on fake tensors (a planner error, not one of the run: "
        "please report it with the command). --no-plan-check starts without it, giving --micro-batch-size "
        "--gradient-checkpointing --rollout-micro-batch-size yourself (the plan sizes them)"
    ]
