"""2x2 latent patch packing: the inverse of unpacking, the same permutation and position ids as FluxPipeline's."""

from __future__ import annotations

import torch
from diffusers import FluxPipeline

from miles.models.packing import pack_latents, packed_position_ids, unpack_latents


def test_packing_is_fluxs_permutation_and_unpacking_inverts_it():
    latents = torch.randn(2, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    packed = pack_latents(latents)
    assert packed.shape == (2, 2 * 3, 12)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 3, 4, 6))
    assert torch.equal(packed[0, 1, :4], latents[0, 0, 0:2, 2:4].flatten())  # patch (0, 1), first channel
    assert torch.equal(unpack_latents(packed, 4, 6), latents)


def test_position_ids_are_first_row_column_as_fluxs():
    ids = packed_position_ids(2, 3, "cpu", torch.float32)
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(1, 2, 3, "cpu", torch.float32))
    assert ids[4].tolist() == [0.0, 1.0, 1.0]
    assert packed_position_ids(2, 3, "cpu", torch.bfloat16, first=1.0)[:, 0].eq(1).all()  # Kontext's source tokens
