"""The learned shapes rewards on CUDA: the frozen networks move to the input's device, the scores equal the CPU
ones, and the gradient reaches the input there (what a reward-gradient algorithm does in the trainer)."""

import numpy as np
import pytest
import torch

from miles.arguments.parser import default_args
from miles.data.shapes import shapes_items
from miles.rollout.rm_hub import REWARD_FUNCTIONS, differentiable_of
from miles.rollout.rm_hub import learned_shapes as ls


@pytest.mark.parametrize("name", ["shapes_learned", "shapes_learned_latent"])
def test_scores_and_gradients_on_cuda_match_cpu(name):
    items = shapes_items(8, seed=5, split="eval")
    metadatas = [item["metadata"] for item in items]
    pixels = torch.from_numpy(np.stack([np.asarray(i["image"], dtype=np.float32) / 255 for i in items]))
    pixels = pixels.permute(0, 3, 1, 2).contiguous()
    declared = differentiable_of(REWARD_FUNCTIONS[name])
    cpu_inputs = pixels if declared.inputs == ls.IMAGE else ls.encode_images(pixels)
    cuda_inputs = cpu_inputs.cuda().requires_grad_(True)
    scores = declared.score(default_args(), cuda_inputs, metadatas)
    assert scores.device.type == "cuda"
    torch.testing.assert_close(scores.cpu(), declared.score(default_args(), cpu_inputs, metadatas), atol=1e-4, rtol=0)
    scores.sum().backward()
    assert bool(torch.isfinite(cuda_inputs.grad).all()) and float(cuda_inputs.grad.abs().max()) > 0
