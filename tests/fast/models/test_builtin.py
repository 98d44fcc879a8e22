"""The built-in checkpoints: every `builtin:` name resolves to a folder of its family, built once under the cache
lock with toy default sizes; an unknown name lists the known ones; a run's media kind is known before any import."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from miles.models import get_train_pipeline_config
from miles.models.builtin import BUILTIN_NAMES, makes_video, resolve_checkpoint

# name -> (pipeline class, family, default latent shape): written out here, not read from the table under test
EXPECTED = {
    "builtin:tiny-shapes": ("StableDiffusion3Pipeline", "sd3", (4, 16, 16)),  # pretrained at 64 px
    "builtin:tiny-shapes-edit": ("FluxKontextPipeline", "flux-kontext", (4, 16, 16)),  # pretrained at 32 px
    "builtin:tiny-moving-shapes": ("WanPipeline", "wan", (4, 5, 16, 16)),  # 5 frames at 32 px, a frame-wise 2x VAE
    "builtin:tiny-sd3": ("StableDiffusion3Pipeline", "sd3", (4, 8, 8)),
    "builtin:tiny-flux": ("FluxPipeline", "flux", (4, 8, 8)),
    "builtin:tiny-flux-kontext": ("FluxKontextPipeline", "flux-kontext", (4, 8, 8)),
    "builtin:tiny-flux2-klein": ("Flux2KleinPipeline", "flux2", (16, 8, 8)),  # 64 px, 2x2-patchified latents
    "builtin:tiny-flux2-dev": ("Flux2Pipeline", "flux2-dev", (16, 8, 8)),
    "builtin:tiny-qwen-image": ("QwenImagePipeline", "qwen-image", (4, 8, 8)),
    "builtin:tiny-qwen-image-edit": ("QwenImageEditPipeline", "qwen-image-edit", (4, 8, 8)),
    "builtin:tiny-qwen-image-edit-plus": ("QwenImageEditPlusPipeline", "qwen-image-edit-plus", (4, 8, 8)),
    "builtin:tiny-wan": ("WanPipeline", "wan", (4, 2, 4, 4)),  # 5 frames at 32 px
    "builtin:tiny-wan-2-experts": ("WanPipeline", "wan", (4, 2, 4, 4)),
    "builtin:tiny-wan-i2v": ("WanImageToVideoPipeline", "wan-i2v", (4, 2, 4, 4)),
    "builtin:tiny-hunyuan-video15": ("HunyuanVideo15Pipeline", "hunyuan-video15", (4, 2, 8, 8)),  # 5 frames, 32 px
    "builtin:tiny-ltx2": ("LTX2Pipeline", "ltx2", (512 + 1008,)),  # 121 frames at 32 px: video then audio dims
    "builtin:tiny-z-image": ("ZImagePipeline", "z-image", (4, 8, 8)),
}


@pytest.fixture(scope="session")
def builtin_folders(tmp_path_factory):
    """Every builtin name resolved once per session, into a cache of the session's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MILES_CACHE", str(tmp_path_factory.mktemp("miles_cache")))
        return {name: resolve_checkpoint(name) for name in BUILTIN_NAMES}


def test_every_builtin_name_resolves_to_a_folder_of_its_family(builtin_folders):
    assert set(builtin_folders) == set(EXPECTED)
    for name, (pipeline, family_name, shape) in EXPECTED.items():
        index = json.loads((Path(builtin_folders[name]) / "model_index.json").read_text())
        assert index["_class_name"] == pipeline, name
        family = get_train_pipeline_config(builtin_folders[name])
        assert (family.name, family.latent_shape()) == (family_name, shape), name
    assert get_train_pipeline_config(builtin_folders["builtin:tiny-wan-2-experts"]).two_experts
    assert not get_train_pipeline_config(builtin_folders["builtin:tiny-wan"]).two_experts


def test_the_shipped_moving_shapes_model_samples_clips_of_its_world():
    from miles.rollout.engine import DiffusionEngine
    from miles.rollout.engine_api import GenerateRequest

    engine = DiffusionEngine(resolve_checkpoint("builtin:tiny-moving-shapes"))  # shipped: nothing to build
    prompts = ["a red circle moving to the left", "a blue square moving up"]
    request = GenerateRequest(prompts, [0, 1], 2, 1.0, "", "ode", 0.0, [])
    result = engine.generate(request)
    assert result.images.shape == (2, 5, 32, 32, 3) and result.images.dtype == np.uint8 and result.fps > 0
    assert 0 < result.images.std()  # not a blank canvas


def test_a_built_folder_is_reused_not_rebuilt(builtin_folders, monkeypatch):
    folder = builtin_folders["builtin:tiny-flux"]
    monkeypatch.setenv("MILES_CACHE", os.path.dirname(folder))
    monkeypatch.setattr("miles.models.builtin.import_module", lambda name: pytest.fail(f"rebuilt with {name}"))
    assert resolve_checkpoint("builtin:tiny-flux") == folder


def test_an_unknown_builtin_name_lists_every_known_one():
    with pytest.raises(ValueError, match="unknown built-in checkpoint 'builtin:tiny-cogvideox'; known: ") as error:
        resolve_checkpoint("builtin:tiny-cogvideox")
    assert all(name in str(error.value) for name in EXPECTED)


def test_a_run_knows_whether_its_model_makes_video_before_importing_a_family(builtin_folders, tmp_path):
    for name, (_, family, _) in EXPECTED.items():
        video = family in ("wan", "wan-i2v", "ltx2", "hunyuan-video15")
        assert makes_video(name) == video and makes_video(builtin_folders[name]) == video, name
    assert makes_video("/nowhere", "wan") and not makes_video(builtin_folders["builtin:tiny-wan"], "sd3")
    assert not makes_video("/nowhere") and not makes_video(None)
    (tmp_path / "model_index.json").write_bytes(b"\xff\x00")
    assert not makes_video(str(tmp_path))  # the start-up checks name a broken folder
