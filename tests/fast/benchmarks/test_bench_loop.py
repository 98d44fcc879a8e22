"""benchmarks/bench_loop.py's measuring parts (its runs are whole training runs: too slow for the fast suite): the
CPU meter counts descendants per phase, a rollout's seconds, and the side flags."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

SPIN = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("benchmarks/bench_loop.py")


def meter_through_phases(bench) -> dict:
    """A train phase with a spinning child that ends in it, a sleeping sync phase, an uncounted tail: the meter's
    numbers. Run in a process of its own (below): pytest's process has descendants of its own (the suite's background
    jobs, tests/background.py) and threads that would count in its phases."""
    meter = bench.CpuMeter()
    child = subprocess.Popen([sys.executable, "-c", SPIN + "\ninput()"], stdin=subprocess.PIPE)
    key, deadline = (child.pid, psutil.Process(child.pid).create_time()), time.monotonic() + 60
    meter.mark("train")
    while meter.readings.get(key, 0.0) < 0.3:  # until the child's spin is read; this process sleeps
        if time.monotonic() > deadline:
            return {"error": f"the child's CPU was never read: {meter.readings}"}
        time.sleep(0.05)
        meter.cpu_seconds()
    child.communicate(b"\n", timeout=60)  # it ends; its last reading stays counted
    meter.mark("sync")
    time.sleep(0.1)
    meter.mark(None)
    time.sleep(0.05)  # not counted: no phase
    return {
        "cpu": meter.cpu,
        "wall": meter.wall,
        "cores": meter.cores(),
        "train_by_kind": meter.by_kind["train"],
        "train_kinds": list(meter.kind_cores("train")),
        "child_kind": meter.kinds[key],
    }


def test_cpu_meter_counts_descendants_per_phase_and_keeps_one_that_ended():
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in got, got["error"]
    cpu, wall, cores = got["cpu"], got["wall"], got["cores"]
    assert cpu["train"] >= 0.3 - 1e-9 and wall["train"] > 0  # a sum of readings' deltas: 0.2999999999999998 is 0.3
    assert 0 <= cpu["sync"] < 0.1 and wall["sync"] == pytest.approx(0.1, abs=0.09)
    assert cpu["wait"] == 0 and wall["wait"] == 0
    assert cores["train"] > 0 and cores["wait"] == 0
    assert cores["all"] == pytest.approx(sum(cpu.values()) / sum(wall.values()))
    # per kind of process: the same CPU, split; the spinning child is most of "train"
    assert sum(got["train_by_kind"].values()) == pytest.approx(cpu["train"])
    assert got["train_kinds"][0] == got["child_kind"] and got["child_kind"] != "driver"


def test_process_kinds(bench):
    assert bench.process_kind(["ray::EngineActor.generate"]) == "ray::EngineActor"
    assert bench.process_kind(["ray::IDLE"]) == "ray::IDLE"
    assert bench.process_kind(["/x/ray/core/src/ray/raylet/raylet", "--flag"]) == "raylet"
    assert bench.process_kind(["/usr/bin/python3.12", "-u", "/x/ray/dashboard/agent.py", "--a"]) == "agent.py"
    assert bench.process_kind([]) == "?"


def test_rollout_seconds_take_the_wait_when_the_batch_was_generated_ahead(bench):
    record = {"perf/generate_total_s": 2.0, "perf/train_s": 1.0, "perf/weight_sync_s": 0.5}
    assert bench.rollout_seconds(record) == 3.5
    assert bench.rollout_seconds({**record, "perf/generate_wait_s": 0.25}) == 1.75


def test_sides_flag(bench, capsys):
    assert bench.parse_options([]).sides == list(bench.SIDES)
    assert bench.parse_options(["--no-plain", "--sides", "async"]).sides == ["miles (async rollout)"]
    with pytest.raises(SystemExit):
        bench.parse_options(["--sides", "auto,overlap"])
    assert "unknown side(s) ['overlap']" in capsys.readouterr().err


if __name__ == "__main__":  # the meter's scenario in a process whose only descendant is its spinning child
    import importlib.util

    ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    spec = importlib.util.spec_from_file_location("bench_loop", os.path.join(ROOT, "benchmarks", "bench_loop.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_loop"] = module
    spec.loader.exec_module(module)
    print(json.dumps(meter_through_phases(module)))
