"""Re-plans of the micro-batch from a forked copy of a rank after its start-up (miles/plan/copies.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from miles.plan import copies
from miles.plan.run import simulate
from miles.plan.suggest import WINDOW, Change, with_changes
from tests.fast.plan.plan_cases import plan_args

ROOT = Path(__file__).resolve().parents[3]


def replan_from_copy() -> None:
    """Inside `started_ranks` the first plan keeps a copy of rank 0 after its start-up; a re-plan that changes only
    the micro-batch runs its window there and measures what simulating the start-up again measures (every field);
    a change of another flag (checkpointing) does not use it; leaving ends the copies."""
    args = plan_args("--dp-size", "2")
    smaller = with_changes(args, [Change("--micro-batch-size 1", {"micro_batch_size": 1}, WINDOW)])
    checked = with_changes(args, [Change("--gradient-checkpointing", {"gradient_checkpointing": True}, WINDOW)])
    with copies.started_ranks():
        base = simulate(args, ranks=[0])
        kept = list(copies._COPIES or [])
        assert len(kept) == 1 and kept[0].rank == 0, kept
        assert copies.find_copy("actor", 0, kept[0].args) is not None
        from_copy = simulate(smaller, ranks=[0], reuse=base, parts=WINDOW).roles["actor"][0]
        assert copies.find_copy("actor", 0, checked) is None and copies.find_copy("actor", 1, smaller) is None
    assert copies._COPIES is None and not kept[0]._process.is_alive()
    fresh = simulate(smaller, ranks=[0], reuse=base, parts=WINDOW).roles["actor"][0]
    mine, theirs = dataclasses.asdict(from_copy), dataclasses.asdict(fresh)
    mine.pop("seconds"), theirs.pop("seconds")
    assert mine == theirs
    assert from_copy.peaks["train"] < base.roles["actor"][0].peaks["train"]


def test_a_micro_batch_replan_from_the_start_up_copy_plans_what_a_whole_replan_plans():
    """In a fresh interpreter, as `--plan` runs: a copy is kept only where no other thread runs (a fork copies the
    locks other threads hold), and the test process has the suite's threads (Ray's, the background jobs')."""
    code = "from tests.fast.plan.test_copies import replan_from_copy; replan_from_copy()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]


def test_no_copy_is_kept_while_another_thread_runs():
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        with copies.started_ranks():
            copies.keep_copy("actor", 0, plan_args(), lambda changed: None)
            assert not copies._COPIES
    finally:
        stop.set()
        other.join()
