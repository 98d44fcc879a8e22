"""The tiny Wan builder (miles/models/wan/tiny.py): one-expert (Wan 2.1) and two-expert (Wan 2.2 A14B) folders
whose transformers take the UMT5 text and the VAE's latents, its toy sizes as run defaults, and a VAE calibrated to
the per-channel statistics it is given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.models.wan.tiny import (
    TINY_WAN_BOUNDARY_RATIO,
    TINY_WAN_LATENT_CHANNELS,
    TINY_WAN_NUM_FRAMES,
    TINY_WAN_RESOLUTION,
    TINY_WAN_TEMPORAL_FACTOR,
    tiny_wan_transformer,
)
from tests.fast.models.tiny_checks import check_tiny_folder

DEFAULTS = {"resolution": TINY_WAN_RESOLUTION, "num_frames": TINY_WAN_NUM_FRAMES}


@pytest.mark.parametrize(("fixture", "experts"), [("tiny_wan_dir", 1), ("tiny_wan_2_experts_dir", 2)])
def test_each_layout_is_a_wan_folder_whose_experts_fit_the_text_and_latents(request, fixture, experts):
    folder = request.getfixturevalue(fixture)
    configs = check_tiny_folder(folder, "WanPipeline", "wan", DEFAULTS)
    names = [n for n in ("transformer", "transformer_2") if n in configs]
    assert len(names) == experts
    for name in names:
        assert configs[name]["text_dim"] == configs["text_encoder"]["d_model"]
        assert configs[name]["in_channels"] == configs["vae"]["z_dim"] == TINY_WAN_LATENT_CHANNELS
    boundary = json.loads(Path(folder, "model_index.json").read_text())["boundary_ratio"]
    assert boundary == (TINY_WAN_BOUNDARY_RATIO if experts == 2 else None)
    assert (TINY_WAN_NUM_FRAMES - 1) % TINY_WAN_TEMPORAL_FACTOR == 0  # 5 frames: two latent frames


def test_the_transformer_is_seeded_by_the_global_generator():
    torch.manual_seed(3)
    a = tiny_wan_transformer(16).state_dict()
    torch.manual_seed(3)
    b = tiny_wan_transformer(16).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    image = tiny_wan_transformer(16, in_channels=12, image_dim=8)
    assert image.config.in_channels == 12 and image.config.image_dim == 8 and image.config.added_kv_proj_dim == 32
