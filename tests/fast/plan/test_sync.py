"""The weight sync as the planner simulates it (miles/plan/sync.py): what a re-plan of the window takes from the plan
it changes."""

from __future__ import annotations

from miles.plan.process import ProcessPlan
from miles.plan.run import simulate
from miles.plan.suggest import WINDOW, Change, with_changes
from miles.plan.sync import AFTER_WINDOW, take_after_window


def test_take_after_window_copies_the_later_phases_and_the_sleep_copy_only():
    plan = ProcessPlan("actor", 0, {"start-up": 1, "train": 5}, {"start-up": 1, "train": 3})
    other = ProcessPlan("actor", 0, {"start-up": 9, "train": 9, "weight sync": 7, "sleep": 4, "wake": 6}, host_bytes=8)
    other.after = {"train": 9, "weight sync": 2, "sleep": 1, "wake": 2}
    take_after_window(plan, other)
    assert plan.peaks == {"start-up": 1, "train": 5, "weight sync": 7, "sleep": 4, "wake": 6}
    assert plan.after == {"start-up": 1, "train": 3, "weight sync": 2, "sleep": 1, "wake": 2}
    assert plan.host_bytes == 8 and AFTER_WINDOW == ("weight sync", "sleep", "wake")


def test_a_window_replan_takes_the_phases_after_the_window_from_the_plan_it_changes(dp2):
    """A re-plan of the micro-batch or checkpointing (`WINDOW`) simulates the start-up and the window again and takes
    the weight sync from the plan it changes: the peak a whole simulation of the changed flags measures."""
    args, simulation = dp2
    changes = [
        Change("--micro-batch-size 1", {"micro_batch_size": 1}, WINDOW),
        Change("--gradient-checkpointing", {"gradient_checkpointing": True}, WINDOW),
    ]
    changed = with_changes(args, changes)
    window = simulate(changed, ranks=[0], reuse=simulation, parts=WINDOW).roles["actor"][0]
    whole = simulate(changed, ranks=[0], reuse=simulation, parts=("trainer",)).roles["actor"][0]
    assert window.peaks["weight sync"] == whole.peaks["weight sync"] > 0
    assert window.peaks["train"] == whole.peaks["train"] < simulation.roles["actor"][0].peaks["train"]
    assert window.export_bytes == whole.export_bytes and window.passes == whole.passes
