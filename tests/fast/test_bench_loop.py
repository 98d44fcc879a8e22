"""benchmarks/bench_loop.py's measuring parts (its runs are whole training runs: too slow for the fast suite): the
CPU meter counts descendants per phase, a rollout's seconds, and the side flags."""

import subprocess
import sys
import time

import psutil
import pytest

SPIN = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass"


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("benchmarks/bench_loop.py")


def test_cpu_meter_counts_descendants_per_phase_and_keeps_one_that_ended(bench):
    meter = bench.CpuMeter()
    child = subprocess.Popen([sys.executable, "-c", SPIN + "\ninput()"], stdin=subprocess.PIPE)
    key, deadline = (child.pid, psutil.Process(child.pid).create_time()), time.monotonic() + 60
    meter.mark("train")
    while meter.readings.get(key, 0.0) < 0.3:  # until the child's spin is read; this process sleeps
        assert time.monotonic() < deadline, f"the child's CPU was never read: {meter.readings}"
        time.sleep(0.05)
        meter.cpu_seconds()
    child.communicate(b"\n", timeout=60)  # it ends; its last reading stays counted
    meter.mark("sync")
    time.sleep(0.1)
    meter.mark(None)
    time.sleep(0.05)  # not counted: no phase
    assert meter.cpu["train"] >= 0.3 and meter.wall["train"] > 0
    assert 0 <= meter.cpu["sync"] < 0.1 and meter.wall["sync"] == pytest.approx(0.1, abs=0.09)
    assert meter.cpu["wait"] == 0 and meter.wall["wait"] == 0
    cores = meter.cores()
    assert cores["train"] > 0 and cores["wait"] == 0
    assert cores["all"] == pytest.approx(sum(meter.cpu.values()) / sum(meter.wall.values()))
    # per kind of process: the same CPU, split; the spinning child is most of "train"
    assert sum(meter.by_kind["train"].values()) == pytest.approx(meter.cpu["train"])
    kinds = meter.kind_cores("train")
    assert next(iter(kinds)) == meter.kinds[key] and meter.kinds[key] != "driver"


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
