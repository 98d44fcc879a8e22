"""benchmarks/bench_gradient_signal.py: its agreement statistic on gradients of known signal share, and one tiny
run of both losses."""

import math

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("benchmarks/bench_gradient_signal.py")


def gradients(share: float, repeats: int = 24, size: int = 20_000, seed: int = 0) -> torch.Tensor:
    """Rows g + n_r with |g|² / (|g|² + E|n_r|²) = share (a ±1 signal, unit-variance noise per coordinate)."""
    gen = torch.Generator().manual_seed(seed)
    signal = torch.randint(0, 2, (size,), generator=gen).float() * 2 - 1
    noise = torch.randn(repeats, size, generator=gen)
    return math.sqrt(share) * signal + math.sqrt(1 - share) * noise


@pytest.mark.parametrize("share", [0.0, 0.05, 0.3, 0.8])
def test_agreement_recovers_the_signal_share(bench, share):
    agree, stderr = bench.agreement(gradients(share))
    assert abs(agree - share) < 0.02, (agree, share)
    assert 0 < stderr < 0.02


def test_agreement_is_blind_to_per_coordinate_scale_as_adam_is(bench):
    grads = gradients(0.3)
    scale = torch.logspace(-3, 3, grads.shape[1])
    assert bench.agreement(grads * scale)[0] == pytest.approx(bench.agreement(grads)[0], abs=1e-9)
    assert bench.agreement(grads[:1].repeat(5, 1) + 1e-3 * gradients(0.0, repeats=5))[0] > 0.99


def test_agreement_rejects_a_single_gradient(bench):
    with pytest.raises(ValueError, match="R >= 2"):
        bench.agreement(torch.ones(1, 10))


def test_samples_for_half_signal(bench):
    assert bench.samples_for_half_signal(0.5, 64) == 64
    assert bench.samples_for_half_signal(0.2, 64) == pytest.approx(256)
    assert math.isinf(bench.samples_for_half_signal(0.0, 64))
    assert math.isinf(bench.samples_for_half_signal(-0.01, 64))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--losses", "ppo"], "unknown"),
        (["--repeats", "1"], "--repeats"),
        (["--samples-per-prompt", "1"], "--samples-per-prompt"),
        (["--prompts", "0"], "--prompts"),
        (["--num-steps", "4", "--num-sde-steps", "4"], "--num-sde-steps"),
    ],
)
def test_bad_flags_are_named(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_both_losses_run_on_the_tiny_model(bench, tiny_pipeline_dir):
    results = bench.main(
        [
            "--hf-checkpoint",
            tiny_pipeline_dir,
            "--reward",
            "brightness",
            "--repeats",
            "3",
            "--prompts",
            "2",
            "--samples-per-prompt",
            "2",
            "--num-steps",
            "4",
            "--num-sde-steps",
            "2",
        ]
    )
    assert set(results) == {"policy_loss", "nft"}
    for result in results.values():
        assert -1.0 <= result["agreement"] <= 1.0
        assert math.isfinite(result["stderr"]) and result["stderr"] >= 0
        assert result["reward_spread"] > 0  # the random tiny model's brightness differs within a group
