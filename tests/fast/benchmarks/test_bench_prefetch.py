"""benchmarks/bench_prefetch.py: both sides through real trainer ranks on tiny settings, and its flag checks."""

import pytest


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("benchmarks/bench_prefetch.py")


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--pairs", "5", "--windows", "2"], "multiple of --windows"), (["--repeats", "0"], "--repeats")],
)
def test_bad_flags_are_named(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_both_sides_run_and_agree_bit_for_bit(bench, ray_cluster, tiny_pipeline_dir, capsys):
    result = bench.main(
        [
            *("--hf-checkpoint", tiny_pipeline_dir, "--pairs", "4", "--windows", "2", "--micro-batch-size", "1"),
            *("--prepare-ms", "5", "--repeats", "1"),
        ]
    )
    assert result["bit_identical"] is True and result["per_window"] == 2
    for side in ("off", "on"):  # the hook's cost, measured inside it, once per micro-batch
        assert result["medians"][side]["prepare_s"] >= 4 * 0.005
    off = result["medians"]["off"]
    assert off["step_s"] >= off["prepare_s"]  # without prefetch every prepare is inside the training loop's time
    assert "bit-identical off / on: True" in capsys.readouterr().out
