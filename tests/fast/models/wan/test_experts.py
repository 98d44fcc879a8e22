"""Wan 2.2's two experts: each row goes to the expert of its timestep, as WanPipeline routes it."""

from __future__ import annotations

import torch

from miles.models import WanExperts, get_train_pipeline_config

PROMPTS = ["a red circle", "a blue square", "two green triangles"]


def test_two_experts_route_each_row_as_the_pipeline_does(tiny_wan_2_experts_dir):
    """Rows at t >= boundary (875) go to `transformer`, the others to `transformer_2` (WanPipeline's rule), in one
    mixed batch: each row equals its expert's own forward of that row alone."""
    family = get_train_pipeline_config(tiny_wan_2_experts_dir, num_frames=5)
    experts = family.load_transformer()
    assert isinstance(experts, WanExperts) and family.boundary_timestep == 875.0
    calls = {"transformer": [], "transformer_2": []}
    for name in calls:
        getattr(experts, name).register_forward_hook(
            lambda module, args, kwargs, out, name=name: calls[name].append(kwargs["timestep"].tolist()),
            with_kwargs=True,
        )
    sigmas = torch.tensor([0.9, 0.875, 0.85])  # one step on each side of the boundary, one on it
    latents = torch.randn(3, *family.latent_shape(32), generator=torch.Generator().manual_seed(0))
    embeds = family.encode_prompts(PROMPTS)
    with torch.no_grad():
        mixed = family.predict_velocity(experts, latents, sigmas, embeds)
    assert calls == {"transformer": [[900.0, 875.0]], "transformer_2": [[850.0]]}
    for row, expert in enumerate([experts.transformer, experts.transformer, experts.transformer_2]):
        with torch.no_grad():
            alone = expert(
                hidden_states=latents[row : row + 1],
                timestep=sigmas[row : row + 1] * 1000,
                encoder_hidden_states=embeds["prompt_embeds"][row : row + 1],
                return_dict=False,
            )[0]
        assert (mixed[row] - alone[0]).abs().max().item() <= 1e-5, row
    # the experts differ, so a wrong route would show
    with torch.no_grad():
        other = experts.transformer_2(
            hidden_states=latents[:1], timestep=sigmas[:1] * 1000, encoder_hidden_states=embeds["prompt_embeds"][:1]
        )[0]
    assert (mixed[0] - other[0]).abs().max().item() > 1e-3
