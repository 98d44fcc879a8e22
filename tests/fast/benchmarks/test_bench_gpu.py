"""benchmarks/bench_gpu.py: FLOPs counted on the meta device, and the whole step path on a toy model on CPU."""

import pytest


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("benchmarks/bench_gpu.py")


def test_flops_of_a_linear_stack_match_the_textbook_count(bench):
    # forward ≈ 2·N·T and backward ≈ twice that: the count lies between one forward's worth and twice 6·N·T
    preset = bench.PRESETS["tiny"]
    params, flops = bench.count_step_flops(preset, 64)
    tokens = (64 // 8 // 2) ** 2 + preset.text_tokens
    assert 0 < flops <= 6 * params * tokens * 2  # attention adds at most a few percent at this size
    assert flops >= 2 * params * tokens  # at least a forward's worth of the block matmuls


def test_flux_dev_step_is_counted_without_materialising_12b_parameters(bench):
    params, flops = bench.count_step_flops(bench.PRESETS["flux-dev"], 1024)
    assert 11.8e9 < params < 12.0e9  # FLUX.1-dev's published 12B
    assert 200e12 < flops < 6 * params * (4096 + 512)  # the per-sample adaLN projections are not per-token FLOPs


def test_cpu_step_path_runs_on_the_toy_models_with_and_without_sequence_parallelism(bench, capsys):
    argv = ["--preset", "tiny", "--preset", "tiny-wan-sp2", "--device", "cpu", "--resolution", "64"]
    results = bench.main([*argv, "--warmup", "1", "--steps", "1"])
    for name in ("tiny", "tiny-wan-sp2"):  # the second: two spawned gloo ranks splitting one clip's tokens
        row = results[name]
        assert row["oom"] is False and row["step_s"] > 0 and row["peak_bytes"] is None
    out = capsys.readouterr().out
    assert "tiny " in out and "5x32x32 sp2" in out


def test_the_14b_sequence_parallel_preset_splits_a_720p_clip_over_8_ranks(bench):
    preset = bench.PRESETS["wan2.1-14b-sp8"]
    frames, height, width = preset.video
    tokens = ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)
    assert tokens == 75_600 and tokens % preset.sp_size == 0
    assert preset.config["num_attention_heads"] % preset.sp_size == 0
    assert "wan2.1-14b-sp8" not in bench.REAL_PRESETS  # the default run has one GPU


def test_lora_step_trains_the_adapters_on_a_frozen_base_and_counts_no_weight_gradients(bench, capsys):
    preset = bench.PRESETS["tiny"]
    full, frozen = bench.count_step_flops(preset, 64)[1], bench.count_step_flops(preset, 64, frozen=True)[1]
    assert 0.5 * full < frozen < full  # the activations' gradients remain; the weights' (about a third) go
    row = bench.main(
        [
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--resolution",
            "64",
            "--warmup",
            "0",
            "--steps",
            "1",
            "--lora-rank",
            "2",
        ]
    )["tiny"]
    assert row["oom"] is False and row["step_s"] > 0 and 0 < row["trained_params"] < row["params"] / 10
    assert "LoRA rank 2 on a bf16 base" in capsys.readouterr().out
