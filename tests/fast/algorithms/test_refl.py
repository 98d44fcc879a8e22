"""The refl declaration: its step range rule and what it declares."""

from miles.algorithms.refl import ALGORITHM, validate
from miles.arguments.parser import default_args


def test_the_step_range_fits_the_grid():
    assert validate(default_args(loss_type="refl", refl_last_steps=10, diffusion_num_steps=10)) == []
    assert validate(default_args(loss_type="refl", refl_last_steps=11, diffusion_num_steps=10)) == [
        "--refl-last-steps 11 must be <= --diffusion-num-steps 10"
    ]


def test_it_back_propagates_a_differentiable_reward_through_ode_samples():
    assert (
        ALGORITHM.differentiable_reward(default_args()) and not ALGORITHM.samples_sde and not ALGORITHM.log_prob_ratio
    )
    assert ALGORITHM.role_names == ["actor"] and not ALGORITHM.flag_ranges["refl_last_steps"].contains(0)
