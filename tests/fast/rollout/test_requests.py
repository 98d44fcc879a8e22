"""Per-sample noise seeds of a rollout, and the shared initial latent of --diffusion-shared-initial-noise."""

from miles.rollout.requests import group_initial_seeds
from miles.rollout.steps import sample_seed
from miles.utils.types import Sample


def test_sample_seeds_differ_by_rollout_and_index():
    seeds = {sample_seed(42, rollout, index) for rollout in range(3) for index in range(8)}
    assert len(seeds) == 24
    assert sample_seed(42, 1, 5) == sample_seed(42, 1, 5) != sample_seed(43, 1, 5)


def test_group_initial_seeds_are_each_groups_first_seed():
    samples = [Sample(index=i, prompt="p", metadata={}, group_index=i // 3, seed=100 + i) for i in range(6)]
    assert group_initial_seeds(samples) == [100, 100, 100, 103, 103, 103]
