"""Re-plans of the micro-batch from a forked copy of a rank after its start-up (miles/plan/copies.py)."""

from __future__ import annotations

import dataclasses

from miles.plan import copies
from miles.plan.run import simulate
from miles.plan.suggest import WINDOW, Change, with_changes


def test_a_micro_batch_replan_from_the_start_up_copy_plans_what_a_whole_replan_plans(dp2):
    """Inside `started_ranks` the first plan keeps a copy of rank 0 after its start-up; a re-plan that changes only
    the micro-batch runs its window there and measures what simulating the start-up again measures (every field);
    a change of another flag (checkpointing) does not use it; leaving ends the copies."""
    args, _ = dp2
    smaller = with_changes(args, [Change("--micro-batch-size 1", {"micro_batch_size": 1}, WINDOW)])
    checked = with_changes(args, [Change("--gradient-checkpointing", {"gradient_checkpointing": True}, WINDOW)])
    with copies.started_ranks():
        base = simulate(args, ranks=[0])
        kept = list(copies._COPIES)
        assert len(kept) == 1 and kept[0].rank == 0
        assert copies.find_copy("actor", 0, copies._COPIES[0].args) is not None
        from_copy = simulate(smaller, ranks=[0], reuse=base, parts=WINDOW).roles["actor"][0]
        assert copies.find_copy("actor", 0, checked) is None and copies.find_copy("actor", 1, smaller) is None
    assert copies._COPIES is None and not kept[0]._process.is_alive()
    fresh = simulate(smaller, ranks=[0], reuse=base, parts=WINDOW).roles["actor"][0]
    mine, theirs = dataclasses.asdict(from_copy), dataclasses.asdict(fresh)
    for timing in ("seconds",):
        mine.pop(timing), theirs.pop(timing)
    assert mine == theirs
    assert from_copy.peaks["train"] < base.roles["actor"][0].peaks["train"]
