"""The differentiable-reward record: the built-in declarations agree with the argument tables and the reward
functions, and each one's score has a finite, nonzero gradient in its input (what a reward-gradient loss needs)."""

import numpy as np
import pytest
import torch

from miles.arguments.parser import default_args
from miles.arguments.reward_spec import DIFFERENTIABLE_REWARDS
from miles.data.shapes import shapes_items
from miles.models.shapes_reward import net
from miles.models.shapes_reward.differentiable import BUILTIN_DIFFERENTIABLE, differentiable_of
from miles.rollout.rm_hub import REWARD_FUNCTIONS


def test_the_declarations_agree_with_the_tables_and_the_reward_functions():
    assert {name: d.inputs for name, d in BUILTIN_DIFFERENTIABLE.items()} == DIFFERENTIABLE_REWARDS
    for name, fn in REWARD_FUNCTIONS.items():
        assert differentiable_of(fn) is BUILTIN_DIFFERENTIABLE.get(name), name
    assert BUILTIN_DIFFERENTIABLE["shapes_learned_latent"].latent_checkpoint == net.LATENT_CHECKPOINT


def test_a_function_without_the_attribute_is_known_by_its_values_only():
    def rm(args, samples):
        return [0.0] * len(samples)

    assert differentiable_of(rm) is None
    rm.differentiable = "image"  # not a DifferentiableReward: ignored
    assert differentiable_of(rm) is None


@pytest.mark.parametrize("name", sorted(BUILTIN_DIFFERENTIABLE))
def test_gradient_in_the_input_is_finite_and_nonzero(name):
    items = shapes_items(4, seed=11, split="eval")
    metadatas = [item["metadata"] for item in items]
    pixels = torch.from_numpy(np.stack([np.asarray(i["image"], dtype=np.float32) / 255 for i in items]))
    pixels = pixels.permute(0, 3, 1, 2).contiguous()
    declared = BUILTIN_DIFFERENTIABLE[name]
    inputs = pixels if declared.inputs == net.IMAGE else torch.randn(4, 4, 16, 16)
    inputs = inputs.clone().requires_grad_(True)
    scores = declared.score(default_args(), inputs, metadatas)
    assert scores.shape == (4,)
    scores.sum().backward()
    assert bool(torch.isfinite(inputs.grad).all())
    assert bool((inputs.grad.flatten(1).abs().amax(dim=1) > 0).all())  # every sample's score moves with its input
