"""The shared initial latent of --diffusion-shared-initial-noise: each group's first sample's seed."""

from miles.rollout.requests import group_initial_seeds
from miles.utils.types import Sample


def test_group_initial_seeds_are_each_groups_first_seed():
    samples = [Sample(index=i, prompt="p", metadata={}, group_index=i // 3, seed=100 + i) for i in range(6)]
    assert group_initial_seeds(samples) == [100, 100, 100, 103, 103, 103]
