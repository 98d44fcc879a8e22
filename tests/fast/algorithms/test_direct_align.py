"""The direct_align declaration: the σ window below 1 and a step Δσ that keeps σ_lo above 0."""

from miles.algorithms.direct_align import ALGORITHM, validate
from miles.arguments.parser import default_args


def test_the_sigma_window_and_the_step():
    assert validate(default_args(loss_type="direct_align")) == []
    assert validate(default_args(loss_type="direct_align", direct_align_sigma_max=1.0)) == [
        "--direct-align-sigma-min 0.75 <= --direct-align-sigma-max 1.0 < 1 must hold"
    ]
    assert validate(default_args(loss_type="direct_align", direct_align_delta_sigma=0.8)) == [
        "--direct-align-delta-sigma 0.8 must be below --direct-align-sigma-min 0.75 (σ_lo > 0)"
    ]


def test_it_takes_a_stale_batch_and_reads_the_shared_flags():
    assert (
        ALGORITHM.async_rollout
        and ALGORITHM.differentiable_reward(default_args())
        and "reward_grad_scale" in ALGORITHM.reads
    )
