"""benchmarks/bench_soak.py's analysis on made-up curves: a flat run is within the bound, a leaking process or a
climbing tree is named, the teardown (processes reading 0 or gone) is not taken for the end, and processes that
come and go are listed apart."""

from __future__ import annotations

import pytest

MIB = 2**20


def curve(rollouts: int, rss, fds=lambda pid, r: 10, pids=(1, 2), teardown: bool = True) -> list[dict]:
    samples = [
        {
            "t": float(r),
            "rollout": r,
            "procs": {pid: {"label": f"p{pid}", "rss": rss(pid, r), "fds": fds(pid, r)} for pid in pids},
        }  # fmt: skip
        for r in range(rollouts)
    ]
    if teardown:  # the run's end: its actors die (RSS 0), then only the driver is left
        samples.append({"t": rollouts + 1.0, "rollout": rollouts - 1, "procs": {p: {"label": f"p{p}", "rss": 0, "fds": 0}
                                                                             for p in pids}})  # fmt: skip
        samples.append({"t": rollouts + 2.0, "rollout": rollouts - 1, "procs": {}})
    return samples


@pytest.fixture(scope="module")
def soak(load_script):
    return load_script("benchmarks/bench_soak.py")


def test_a_flat_run_is_within_the_bound_and_ends_before_its_teardown(soak):
    result = soak.analyse(curve(100, lambda pid, r: 500 * MIB + (r % 3) * MIB), warmup=10)
    assert result["problems"] == []
    assert result["start"]["rollout"] == 10 and result["end"]["rollout"] == 99
    assert all(row["rss_end"] > 0 for row in result["processes"])


def test_a_leaking_process_and_a_climbing_tree_are_named(soak):
    leak = lambda pid, r: (500 + (r * 0.5 if pid == 2 else 0)) * MIB  # noqa: E731 - 50 MiB per 100 rollouts
    problems = soak.analyse(curve(200, leak), warmup=20)["problems"]
    assert any(p.startswith("p2 (pid 2) RSS grew") for p in problems), problems
    assert any("still climbs" in p for p in problems), problems
    assert not any(p.startswith("p1 ") for p in problems)


def test_open_files_that_pile_up_are_named(soak):
    problems = soak.analyse(curve(60, lambda pid, r: 100 * MIB, fds=lambda pid, r: 10 + r // 5), warmup=6)["problems"]
    assert [p.split(" open files")[0] for p in problems] == ["p1 (pid 1)", "p2 (pid 2)"]


def test_a_process_that_comes_and_goes_is_listed_not_compared(soak):
    samples = curve(50, lambda pid, r: 100 * MIB, teardown=False)
    for s in samples[20:30]:
        s["procs"][9] = {"label": "helper", "rss": 900 * MIB, "fds": 99}
    result = soak.analyse(samples, warmup=5)
    assert result["transient"] == ["helper"] and result["problems"] == []
    assert {row["pid"] for row in result["processes"]} == {1, 2}


def test_too_short_a_run_says_so(soak):
    with pytest.raises(SystemExit, match="fewer than two samples after the warm-up"):
        soak.analyse(curve(5, lambda pid, r: MIB), warmup=10)
