"""The embedded default (§9): the shipped shapes model loads in plain diffusers and draws recognisable shapes."""

import pytest

from miles.models.builtin import SHIPPED_SHAPES_DIR

pytestmark = pytest.mark.e2e


def test_shipped_model_loads_in_plain_diffusers_and_draws_shapes():
    import numpy as np
    import torch
    from diffusers import StableDiffusion3Pipeline

    from miles.rollout.rm_hub.shapes import shapes_reward

    pipe = StableDiffusion3Pipeline.from_pretrained(SHIPPED_SHAPES_DIR)
    images = pipe(
        ["two red circles on the left"] * 4,
        num_inference_steps=20,
        guidance_scale=4.5,
        height=32,
        width=32,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    scores = shapes_reward(
        [(np.asarray(im) * 255).round().astype("uint8") for im in images],
        [{"color": "red", "shape": "circle", "count": 2, "position": "left"}] * 4,
    )
    # red ink, two objects, on the left: what the shipped model gets right (~99%) and a random model draws as noise
    for attribute in ("color", "count", "position"):
        assert np.mean([getattr(s, attribute) for s in scores]) > 0.75, attribute
