"""The draft declaration: K within the grid, DRaFT-LV only at K = 1."""

from miles.algorithms.draft import ALGORITHM, validate
from miles.arguments.parser import default_args


def test_k_fits_the_grid_and_lv_needs_k_one():
    assert validate(default_args(loss_type="draft", draft_k=10, diffusion_num_steps=10)) == []
    assert validate(default_args(loss_type="draft", draft_k=11, diffusion_num_steps=10)) == [
        "--draft-k 11 must be <= --diffusion-num-steps 10"
    ]
    assert validate(default_args(loss_type="draft", draft_k=2, draft_lv_copies=2)) == [
        "--draft-lv-copies 2 (DRaFT-LV) needs --draft-k 1, got 2"
    ]
    assert validate(default_args(loss_type="draft", draft_k=1, draft_lv_copies=2)) == []


def test_it_reads_the_shared_reward_gradient_flags():
    assert ALGORITHM.differentiable_reward(default_args()) and "reward_grad_hinge" in ALGORITHM.reads
